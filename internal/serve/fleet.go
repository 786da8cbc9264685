package serve

import "github.com/kvrouter/kvrouter/mocker/fleet"

// device is how engine i of the fleet announces itself: a spec's :cpu
// makes it a CPU engine, the others are accelerators.
func device(cfg fleet.Config, i int) string {
	if i < len(cfg.Specs) && cfg.Specs[i].CPU {
		return "cpu"
	}
	return ""
}

// FleetWorkers describes the engines of a simulated fleet, started with
// cfg, as the frontend's workers: ids 1..N in the fleet's order, each with
// its first rank's event endpoints (later ranks are numbered from them) and
// its dump endpoint, its role and its tokenizer.
func FleetWorkers(f *fleet.Fleet, cfg fleet.Config) []WorkerSpec {
	var out []WorkerSpec
	for i, e := range f.Engines() {
		out = append(out, WorkerSpec{
			ID: uint64(i + 1), Name: e.Name, URL: e.HTTPURL, Model: cfg.Server.Model, DPSize: len(e.Ranks),
			Events: e.Ranks[0].Events, Replay: e.Ranks[0].Replay, Dump: e.HTTPURL + "/kv_events/dump",
			KVBlocks: cfg.EngineConfig(i).NumGPUBlocks, MaxBatchedTokens: cfg.Engine.MaxNumBatchedTokens,
			Role: string(e.Role), Tokenizer: cfg.Tokenizer, Device: device(cfg, i),
		})
	}
	return out
}
