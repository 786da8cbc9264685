package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/mocker/fleet"
	"github.com/kvrouter/kvrouter/mocker/server"
)

// simEngines are simulated engines a benchmark sends load to, in this
// process or in a child process.
type simEngines struct {
	workers []serve.WorkerSpec
	model   string
	// timing sums the engines' pacing figures (server.Timing) now.
	timing func(context.Context) (server.Timing, error)
	close  func() error
}

// startFleet runs the engines in this process: they share the cores with
// the frontend and the clients, goroutine for goroutine.
func startFleet(ctx context.Context, fcfg fleet.Config) (*simEngines, error) {
	var f *fleet.Fleet
	err := labelled(ctx, "engines", func(ctx context.Context) (err error) {
		f, err = fleet.Start(ctx, fcfg)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &simEngines{
		workers: serve.FleetWorkers(f, fcfg),
		model:   fcfg.Server.Model,
		timing:  func(context.Context) (server.Timing, error) { return f.Timing(), nil },
		close:   func() error { f.Close(); return nil },
	}, nil
}

// EngineProcess runs simulated engines as `kvrouter mocker` in a child
// process at a lower CPU priority.
type EngineProcess struct {
	Binary string // the kvrouter binary
	// Nice is the child's niceness (nice(1)): at 10 the kernel gives a
	// runnable frontend about nine times the CPU share of a runnable
	// engine, as if the engines ran on hardware of their own, which real
	// ones do (GPUs and their hosts), so that a frontend's latency is not
	// its wait for a core an engine simulation holds.
	Nice int
}

// engineReadyTimeout bounds the child's start.
const engineReadyTimeout = 60 * time.Second

// start runs fcfg's engines as a child process and waits until they listen.
func (p EngineProcess) start(ctx context.Context, fcfg fleet.Config, progress io.Writer) (*simEngines, error) {
	if progress == nil {
		progress = io.Discard
	}
	nice, err := exec.LookPath("nice")
	if err != nil {
		return nil, fmt.Errorf("engines in a child process need nice(1): %w", err)
	}
	dir, err := os.MkdirTemp("", "kvrouter-bench-engines-")
	if err != nil {
		return nil, err
	}
	config := filepath.Join(dir, "serve.json")
	args := []string{"-n", strconv.Itoa(p.Nice), p.Binary, "mocker",
		"--num-workers", strconv.Itoa(fcfg.NumWorkers), "--speedup-ratio", strconv.FormatFloat(fcfg.SpeedupRatio, 'g', -1, 64),
		"--host", "127.0.0.1", "--http-port", "0", "--kv-events-port", "0", "--kv-events-replay-port", "0",
		"--max-model-len", strconv.Itoa(fcfg.Server.MaxModelLen), "--model-name", fcfg.Server.Model,
		"--block-size", strconv.Itoa(fcfg.Engine.BlockSize), "--num-gpu-blocks", strconv.Itoa(fcfg.Engine.NumGPUBlocks),
		"--serve-config", config}
	if fcfg.Tokenizer != "" {
		args = append(args, "--tokenizer", fcfg.Tokenizer)
	}
	log, err := os.Create(filepath.Join(dir, "mocker.log"))
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	defer log.Close() // the child has its own descriptor
	cmd := exec.Command(nice, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	fmt.Fprintf(progress, "engines: kvrouter mocker, pid %d, nice %d, log %s\n", cmd.Process.Pid, p.Nice, log.Name())
	exited := make(chan struct{})
	var waitErr error // read once exited is closed
	go func() {
		waitErr = cmd.Wait()
		close(exited)
	}()
	var once sync.Once
	var closeErr error
	stop := func(keepDir bool) error {
		once.Do(func() {
			// SIGTERM lets the mocker close its sockets; a child that does
			// not stop within the bound is killed.
			_ = cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-exited:
				if waitErr != nil {
					closeErr = fmt.Errorf("engine process: %w (log: %s)", waitErr, log.Name())
				}
			case <-time.After(10 * time.Second):
				_ = cmd.Process.Kill()
				<-exited
				closeErr = fmt.Errorf("engine process %d did not stop on SIGTERM within 10 s: killed (log: %s)", cmd.Process.Pid, log.Name())
			}
			if !keepDir && closeErr == nil {
				os.RemoveAll(dir)
			}
		})
		return closeErr
	}
	workers, err := waitServeConfig(ctx, config, exited, func() error { return waitErr })
	if err != nil {
		_ = stop(true)
		return nil, fmt.Errorf("%w (log: %s)", err, log.Name())
	}
	urls := make([]string, len(workers))
	for i, w := range workers {
		urls[i] = w.URL
	}
	return &simEngines{
		workers: workers,
		model:   fcfg.Server.Model,
		timing:  func(ctx context.Context) (server.Timing, error) { return scrapeTiming(ctx, urls) },
		close:   func() error { return stop(false) },
	}, nil
}

// waitServeConfig polls for the file the child writes once its engines
// listen (it appears whole: see the mocker's --serve-config), bounded by
// engineReadyTimeout, and fails at once if the child exits first.
func waitServeConfig(ctx context.Context, path string, exited <-chan struct{}, exitErr func() error) ([]serve.WorkerSpec, error) {
	deadline := time.NewTimer(engineReadyTimeout)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		b, err := os.ReadFile(path)
		if err == nil {
			var file struct {
				Workers []serve.WorkerSpec `json:"workers"`
			}
			if err := json.Unmarshal(b, &file); err != nil {
				return nil, fmt.Errorf("engine process: %s: %w", path, err)
			}
			return file.Workers, nil
		}
		select {
		case <-exited:
			return nil, fmt.Errorf("engine process exited before its engines listened: %v", exitErr())
		case <-deadline.C:
			return nil, fmt.Errorf("engine process: no engines listening after %v", engineReadyTimeout)
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-tick.C:
		}
	}
}

// scrapeTiming sums the pacing counters of the engines' /metrics.
func scrapeTiming(ctx context.Context, urls []string) (server.Timing, error) {
	var t server.Timing
	for _, u := range urls {
		families, err := ScrapeMetrics(ctx, u)
		if err != nil {
			return t, fmt.Errorf("engine %s /metrics: %w", u, err)
		}
		read := func(name string) (time.Duration, error) {
			ms := families[name].GetMetric()
			if len(ms) == 0 {
				return 0, fmt.Errorf("engine %s exports no %s", u, name)
			}
			var s float64
			for _, m := range ms {
				s += m.GetCounter().GetValue()
			}
			return time.Duration(s * float64(time.Second)), nil
		}
		model, err := read(server.StepModelSecondsMetric)
		if err != nil {
			return t, err
		}
		actual, err := read(server.StepWallSecondsMetric)
		if err != nil {
			return t, err
		}
		t.Model += model
		t.Actual += actual
	}
	return t, nil
}
