package main

import (
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// listeningPorts returns the TCP ports this process listens on, from the
// socket inodes among its descriptors and the kernel's socket tables.
func listeningPorts(t *testing.T) []int {
	t.Helper()
	inodes := map[string]bool{}
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	for _, fd := range fds {
		link, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name()))
		if err == nil && strings.HasPrefix(link, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(link, "socket:["), "]")] = true
		}
	}
	var ports []int
	for _, table := range []string{"/proc/self/net/tcp", "/proc/self/net/tcp6"} {
		b, err := os.ReadFile(table)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			f := strings.Fields(line)
			const listen = "0A"
			if len(f) < 10 || f[3] != listen || !inodes[f[9]] {
				continue
			}
			_, hexPort, _ := strings.Cut(f[1], ":")
			if p, err := strconv.ParseUint(hexPort, 16, 16); err == nil {
				ports = append(ports, int(p))
			}
		}
	}
	slices.Sort(ports)
	return ports
}

// serve with static engines and no NATS flag opens no port but its HTTP
// one: no embedded NATS server that nothing would connect to. Given a NATS
// flag, it starts one.
func TestServeWithStaticWorkersStartsNoNATS(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads the listening sockets from /proc")
	}
	for _, env := range []string{"NATS_SERVER", "NATS_URL", "DYN_NATS_URL", "DYN_NATS_PORT", "DYN_ROUTER_REPLICA_SYNC"} {
		t.Setenv(env, "")
		os.Unsetenv(env)
	}
	cfg, e := mockEngine(t)
	worker := "url=" + e.HTTPURL + ",events=" + e.Ranks[0].Events + ",replay=" + e.Ranks[0].Replay + ",model=" + cfg.Server.Model

	opened := func(args ...string) (ports []int, httpPort int, output string) {
		t.Helper()
		before := listeningPorts(t)
		out, stop := startCmd(t, append([]string{"serve", "--http-host", "127.0.0.1", "--http-port", "0", "--shutdown-timeout", "0", "--worker", worker}, args...)...)
		servingOn := regexp.MustCompile(`serving on http://127\.0\.0\.1:(\d+)`)
		testwait.Until(t, 20*time.Second, "serve is up", func() bool { return servingOn.MatchString(out.String()) })
		httpPort, _ = strconv.Atoi(servingOn.FindStringSubmatch(out.String())[1])
		for _, p := range listeningPorts(t) {
			if !slices.Contains(before, p) {
				ports = append(ports, p)
			}
		}
		if err := stop(); err != nil {
			t.Fatalf("serve %v: %v\n%s", args, err, out.String())
		}
		return ports, httpPort, out.String()
	}

	ports, httpPort, log := opened()
	if !slices.Equal(ports, []int{httpPort}) || strings.Contains(log, "NATS server started") {
		t.Errorf("static engines, no NATS flag: serve opened ports %v (HTTP %d)\n%s", ports, httpPort, log)
	}
	ports, httpPort, log = opened("--nats-port", "0")
	if len(ports) < 2 || !strings.Contains(log, "NATS server started") {
		t.Errorf("--nats-port 0: want the HTTP port %d and the embedded NATS server's, got %v\n%s", httpPort, ports, log)
	}
}
