package main

import (
	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/mocker/engine"
)

// registerHostTier adds the simulated engines' host KV tier: vLLM's CPU
// offloading connector, sized in blocks as --num-gpu-blocks is.
func registerHostTier(fl *pflag.FlagSet, e *engine.Config) {
	fl.IntVar(&e.NumCPUBlocks, "num-cpu-blocks", e.NumCPUBlocks,
		"KV blocks per rank in a host (CPU) tier, as vLLM's offloading connector keeps them: every computed block is copied there, the LRU evicts, a prompt's host hits load instead of prefilling; 0 is none")
	fl.Float64Var(&e.KVOffloadBandwidth, "kv-offload-bandwidth", engine.DefaultKVOffloadBandwidth,
		"GB/s that host blocks load to the GPU at (default: a PCIe Gen4 x16 link), for a model of 128 KiB of KV per token")
}
