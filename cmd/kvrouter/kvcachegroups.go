package main

import (
	"fmt"
	"strings"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/mocker/engine"
)

// kvCacheGroupsFlag is --kv-cache-groups: the simulated engines' KV-cache
// groups, as a hybrid model has them.
type kvCacheGroupsFlag struct{ groups *[]engine.KVCacheGroup }

func (f kvCacheGroupsFlag) String() string {
	if f.groups == nil {
		return ""
	}
	parts := make([]string, len(*f.groups))
	for i, g := range *f.groups {
		parts[i] = g.String()
	}
	return strings.Join(parts, ",")
}

func (f kvCacheGroupsFlag) Set(s string) error {
	g, err := engine.ParseKVCacheGroups(s)
	if err != nil {
		return err
	}
	*f.groups = g
	return nil
}

func (kvCacheGroupsFlag) Type() string { return "groups" }

func registerKVCacheGroups(fl *pflag.FlagSet, e *engine.Config) {
	fl.Var(kvCacheGroupsFlag{&e.KVCacheGroups}, "kv-cache-groups",
		"publish as a hybrid model: its KV-cache groups in group_idx order, kind[:block_size[:window]] each, e.g. sliding_window:32:4096,full_attention:16; "+
			"the first full_attention (or mla_attention, sink_full_attention) group is the engine's own, of --block-size tokens; sliding_window, sliding_window_mla and chunked_local_attention need a window; mamba may be added")
}

// adoptOwnBlockSize takes the engine's block size from its own group in
// --kv-cache-groups when no other flag gave it; a conflict is an error.
func adoptOwnBlockSize(fl *pflag.FlagSet, e *engine.Config, sizeFlags ...string) error {
	if len(e.KVCacheGroups) == 0 {
		return nil
	}
	own := e.KVCacheGroups[e.OwnGroup()]
	if own.BlockSize == 0 || own.BlockSize == e.BlockSize {
		return nil
	}
	for _, name := range sizeFlags {
		if fl.Changed(name) {
			return fmt.Errorf("--kv-cache-groups gives the %s group %d-token blocks, --%s %d", own.Kind, own.BlockSize, name, e.BlockSize)
		}
	}
	e.BlockSize = own.BlockSize
	return nil
}
