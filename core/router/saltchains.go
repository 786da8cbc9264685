package router

// SaltChains carries a cache salt from an engine's salted blocks to the
// blocks that continue them. An engine mixes a request's cache_salt into
// the request's first block only and publishes it in that block's extra
// keys; a later event that stores more blocks of the same chain (the next
// chunk of a long prefill, a conversation's next turn) names its parent
// and carries no salt. The router keys every block of a salted request by
// the salt (see EngineStored.Salt), so such an event must be hashed under
// the salt of its parent.
//
// It remembers the engine hash of every salted block of one rank until the
// engine removes it or clears, up to max blocks; past that, new salted
// blocks are not remembered, and a continuation of one of them is hashed
// unsalted: it then matches no request (its parent's chain is salted),
// which costs credit but never credits a wrong tenant. Not safe for
// concurrent use.
type SaltChains struct {
	salts map[uint64]string
	max   int
	// Full counts salted blocks not remembered for want of room.
	Full uint64
}

// NewSaltChains remembers up to max salted blocks.
func NewSaltChains(max int) *SaltChains {
	return &SaltChains{max: max}
}

// Stored returns the salt of a stored event's blocks, its own (read from
// its first block's extra keys) or else its parent's, and remembers them
// when it is not "".
func (c *SaltChains) Stored(parent *uint64, hashes []uint64, own string) string {
	salt := own
	if salt == "" && parent != nil && len(c.salts) > 0 {
		salt = c.salts[*parent]
	}
	if salt == "" {
		return ""
	}
	if c.salts == nil {
		c.salts = make(map[uint64]string)
	}
	for _, h := range hashes {
		if len(c.salts) >= c.max {
			if _, ok := c.salts[h]; !ok {
				c.Full++
				continue
			}
		}
		c.salts[h] = salt
	}
	return salt
}

// Removed forgets removed blocks.
func (c *SaltChains) Removed(hashes []uint64) {
	if len(c.salts) == 0 {
		return
	}
	for _, h := range hashes {
		delete(c.salts, h)
	}
}

// Clear forgets every block.
func (c *SaltChains) Clear() { c.salts = nil }

// Len is the number of salted blocks remembered.
func (c *SaltChains) Len() int { return len(c.salts) }
