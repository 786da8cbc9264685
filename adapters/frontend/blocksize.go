package frontend

// blockSizeHealth is /health's kv_block_size: the router's block size and
// every engine's. An engine whose blocks are not the router's is routed
// with hashes of its own block size, so a mismatch does not degrade the
// router; it is shown because it usually means a misconfigured flag.
type blockSizeHealth struct {
	Router  int                     `json:"router"`
	Workers []workerBlockSizeHealth `json:"workers"`
}

type workerBlockSizeHealth struct {
	ID        uint64 `json:"id"`
	BlockSize int    `json:"block_size"`
	// Source is "events" (the engine's KV events carry it) or "assumed"
	// (announced in discovery, or the router's own until events say).
	Source   string `json:"source"`
	Mismatch bool   `json:"mismatch"`
}

func (f *Frontend) blockSizeHealth() blockSizeHealth {
	routerSize := f.cfg.Router.BlockSize()
	out := blockSizeHealth{Router: routerSize, Workers: []workerBlockSizeHealth{}}
	for _, w := range f.cfg.Router.WorkerBlockSizes() {
		source := "assumed"
		if w.Learned {
			source = "events"
		}
		out.Workers = append(out.Workers, workerBlockSizeHealth{ID: w.ID, BlockSize: w.BlockSize, Source: source, Mismatch: w.Mismatched(routerSize)})
	}
	return out
}
