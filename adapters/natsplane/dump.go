package natsplane

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvrouter/kvrouter/core/kv"
)

// Dumps and snapshots carry up to millions of single-block Stored events
// (plus the removals of "bridge" blocks an index dump uses to keep blocks
// whose parent is gone); as JSON they would take seconds to decode and tens
// of bytes each. The binary form is a magic number followed by fixed
// 37-byte records: worker u64, dp rank u32, flags u8, parent u64, engine
// hash u64, local hash u64, all little-endian. Flags: 1 = has parent,
// 2 = a removal of the engine hash (parent and local unused); bits 4 and 5
// are the storage tier (0 device, 1 host, 2 disk, 3 external), so a dump
// of device blocks only is what it always was.
var dumpMagic = [4]byte{'K', 'V', 'D', '1'}

const dumpRecord = 8 + 4 + 1 + 8 + 8 + 8

// ErrCorruptDump reports a dump that does not decode.
var ErrCorruptDump = errors.New("natsplane: corrupt dump")

// EncodeDump appends the binary form of events, which must be what index
// dumps produce: single-block stores and removals.
func EncodeDump(dst []byte, events []kv.Event) ([]byte, error) {
	if len(dst) == 0 {
		dst = append(dst, dumpMagic[:]...)
	}
	for i := range events {
		ev := &events[i]
		tier, ok := tierCode(ev.Tier)
		if !ok {
			return nil, fmt.Errorf("natsplane: dump event %d of unknown storage tier %q", i, ev.Tier)
		}
		switch {
		case ev.Kind == kv.KindRemoved:
			for _, h := range ev.Removed.EngineHashes {
				dst = appendRecord(dst, ev.Worker, flagRemoval|tier, 0, h, 0)
			}
		case ev.Kind == kv.KindStored && len(ev.Stored.Blocks) == 1:
			flags := tier
			var parent uint64
			if ev.Stored.Parent != nil {
				flags, parent = flags|flagParent, *ev.Stored.Parent
			}
			dst = appendRecord(dst, ev.Worker, flags, parent, ev.Stored.Blocks[0].EngineHash, ev.Stored.Blocks[0].LocalHash)
		default:
			return nil, fmt.Errorf("natsplane: dump event %d is neither a single-block store nor a removal", i)
		}
	}
	return dst, nil
}

const (
	flagParent  = 1
	flagRemoval = 2
	tierShift   = 4
	tierMask    = 3 << tierShift
)

var dumpTiers = [4]kv.StorageTier{kv.TierDevice, kv.TierHostPinned, kv.TierDisk, kv.TierExternal}

// tierCode is tier's bits in a record's flags.
func tierCode(t kv.StorageTier) (byte, bool) {
	if t == "" {
		return 0, true
	}
	for i, d := range dumpTiers {
		if d == t {
			return byte(i) << tierShift, true
		}
	}
	return 0, false
}

func appendRecord(dst []byte, w kv.Worker, flags byte, parent, engine, local uint64) []byte {
	dst = binary.LittleEndian.AppendUint64(dst, w.ID)
	dst = binary.LittleEndian.AppendUint32(dst, w.DPRank)
	dst = append(dst, flags)
	dst = binary.LittleEndian.AppendUint64(dst, parent)
	dst = binary.LittleEndian.AppendUint64(dst, engine)
	return binary.LittleEndian.AppendUint64(dst, local)
}

// DecodeDump calls fn for each event of a binary dump, reusing one event
// value: fn must not keep it.
func DecodeDump(b []byte, fn func(ev *kv.Event) error) error {
	if len(b) < len(dumpMagic) || [4]byte(b[:4]) != dumpMagic {
		return fmt.Errorf("%w: bad magic", ErrCorruptDump)
	}
	b = b[4:]
	if len(b)%dumpRecord != 0 {
		return fmt.Errorf("%w: %d trailing bytes", ErrCorruptDump, len(b)%dumpRecord)
	}
	var parent uint64
	st := kv.Event{Kind: kv.KindStored, Tier: kv.TierDevice, Stored: kv.Stored{Blocks: make([]kv.Block, 1)}}
	rm := kv.Event{Kind: kv.KindRemoved, Tier: kv.TierDevice, Removed: kv.Removed{EngineHashes: make([]uint64, 1)}}
	for ; len(b) > 0; b = b[dumpRecord:] {
		w := kv.Worker{ID: binary.LittleEndian.Uint64(b), DPRank: binary.LittleEndian.Uint32(b[8:])}
		engine := binary.LittleEndian.Uint64(b[21:])
		ev := &st
		tier := dumpTiers[(b[12]&tierMask)>>tierShift]
		switch b[12] &^ tierMask {
		case 0:
			st.Stored.Parent = nil
		case flagParent:
			parent = binary.LittleEndian.Uint64(b[13:])
			st.Stored.Parent = &parent
		case flagRemoval:
			ev = &rm
			rm.Removed.EngineHashes[0] = engine
		default:
			return fmt.Errorf("%w: flags %d", ErrCorruptDump, b[12])
		}
		ev.Worker, ev.Tier = w, tier
		if ev == &st {
			st.Stored.Blocks[0] = kv.Block{EngineHash: engine, LocalHash: binary.LittleEndian.Uint64(b[29:])}
		}
		if err := fn(ev); err != nil {
			return err
		}
	}
	return nil
}
