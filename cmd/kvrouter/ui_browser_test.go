package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// chromium finds a headless-capable Chromium. CI installs Debian's
// chromium (.ci/run) and must run this test, so there a missing browser
// fails it; elsewhere it is skipped.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("no chromium on PATH: .ci/run installs Debian's chromium package")
	}
	t.Skip("no chromium on PATH (apt-get install chromium to run the dashboard's browser test)")
	return ""
}

// The dashboard in a real browser against up with traffic: it loads with
// no console error, shows every engine by data-worker-id, its numbers move
// as requests flow, and its drain control takes an engine out and back.
// KVROUTER_UI_SCREENSHOT=path.png saves what the page looks like.
func TestUIInBrowser(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a browser")
	}
	browser := chromium(t)
	t.Setenv("NATS_SERVER", "")
	out, stop := startCmd(t, "up", "--http-port", "0", "--workers", "3", "--speedup-ratio", "20", "--nats-port", "0")
	dash := regexp.MustCompile(`Dashboard: (http://\S+)/ui`)
	testwait.Until(t, 30*time.Second, "up to serve", func() bool { return dash.MatchString(out.String()) })
	base := dash.FindStringSubmatch(out.String())[1]

	// Traffic: conversations that share prefixes, so caches and hit rate move.
	trafficCtx, stopTraffic := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { stopTraffic(); wg.Wait() }()
	for c := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; trafficCtx.Err() == nil; i++ {
				prompt := strings.Repeat(fmt.Sprintf("conversation %d says hello to the router. ", c), 12) + strings.Repeat("turn "+strconv.Itoa(i)+" ", 8*(i%3+1))
				body, _ := json.Marshal(map[string]any{"model": "kvrouter-mock", "prompt": prompt, "max_tokens": 8})
				req, _ := http.NewRequestWithContext(trafficCtx, http.MethodPost, base+"/v1/completions", strings.NewReader(string(body)))
				req.Header.Set("Content-Type", "application/json")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					continue // the test is ending
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK && trafficCtx.Err() == nil {
					t.Errorf("traffic: status %d", resp.StatusCode)
					return
				}
			}
		}()
	}

	opts := append(slices.Clone(chromedp.DefaultExecAllocatorOptions[:]), chromedp.ExecPath(browser), chromedp.NoSandbox, chromedp.WindowSize(1440, 1000))
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(allocCtx)
	defer cancelBrowser()
	bctx, cancelTimeout := context.WithTimeout(bctx, 90*time.Second)
	defer cancelTimeout()

	// Every message of the page is read from the start: errors fail the test.
	if _, err := chromedp.Run(bctx, chromedp.Evaluate[int]("1")); err != nil {
		t.Fatal(err) // starts the browser, so that Console has a target
	}
	var mu sync.Mutex
	var problems []string
	consoleCtx, stopConsole := context.WithCancel(bctx)
	defer stopConsole()
	messages := chromedp.Console(consoleCtx)
	consoleDone := make(chan struct{})
	go func() {
		defer close(consoleDone)
		for m, err := range messages {
			if err != nil {
				return
			}
			if m.Type == chromedp.ConsoleError || m.Type == chromedp.ConsoleException {
				mu.Lock()
				problems = append(problems, string(m.Type)+": "+m.Text)
				mu.Unlock()
			}
		}
	}()
	noProblems := func() {
		t.Helper()
		mu.Lock()
		defer mu.Unlock()
		if len(problems) > 0 {
			t.Fatalf("the page reported errors:\n%s", strings.Join(problems, "\n"))
		}
	}
	if err := chromedp.Do(bctx, chromedp.Navigate(base+"/ui")); err != nil {
		t.Fatal(err)
	}

	// poll re-evaluates js until ok says yes; the page updates once a
	// second, so 30 s leaves ample room on a loaded machine.
	poll := func(what, js string, ok func(v json.RawMessage) bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			v, err := chromedp.Run(bctx, chromedp.Evaluate[json.RawMessage](js))
			if err != nil {
				t.Fatalf("%s: %v", js, err)
			}
			if ok(v) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the page did not %s within 30 s (last: %s)", what, v)
			}
			if err := chromedp.Do(bctx, chromedp.Sleep(100*time.Millisecond)); err != nil {
				t.Fatal(err)
			}
		}
	}
	decode := func(raw json.RawMessage, v any) {
		t.Helper()
		if err := json.Unmarshal(raw, v); err != nil {
			t.Fatalf("%s: %v", raw, err)
		}
	}

	poll("show every engine", `[...document.querySelectorAll("#fleet [data-worker-id]")].map(e => e.dataset.workerId)`,
		func(v json.RawMessage) bool {
			var ids []string
			decode(v, &ids)
			return slices.Equal(ids, []string{"1", "2", "3"})
		})

	type numbers struct {
		Total, Rows, Indexed int
	}
	read := `({Total: Number(document.getElementById("k-total").textContent.replace(/\D/g, "")) || 0,
		Rows: document.querySelectorAll("#dec tr").length,
		Indexed: [...document.querySelectorAll(".v-indexed")].reduce((s, e) => s + (Number(e.textContent.split("/")[0].replace(/\D/g, "")) || 0), 0)})`
	var first numbers
	poll("count decisions", read, func(v json.RawMessage) bool { decode(v, &first); return first.Total > 0 })
	poll("move with the traffic", read, func(v json.RawMessage) bool {
		var now numbers
		decode(v, &now)
		return now.Total > first.Total && now.Rows > 0 && now.Indexed > 0
	})
	poll("explain a decision", `document.querySelector("#dec td.c") ? document.querySelector("#dec td.c").textContent : ""`, func(v json.RawMessage) bool {
		var cost string
		decode(v, &cost)
		// Named as the engine cards name them: "engine-0 #1".
		return regexp.MustCompile(`\S+ #\d+: [\d.,-]+ = [\d.,]+ − [\d.,]+ \+ [\d.,]+`).MatchString(cost)
	})
	// The decisions name workers as the cards do, and the page says when
	// decisions are recorded and what a negative cost means.
	poll("name decisions as the cards", `({cards: [...document.querySelectorAll("#fleet [data-worker-id]")].map(e => e.querySelector(".name").textContent + " #" + e.dataset.workerId),
		chosen: document.querySelector("#dec tr td:nth-child(3)").textContent})`, func(v json.RawMessage) bool {
		var got struct {
			Cards  []string
			Chosen string
		}
		decode(v, &got)
		return slices.ContainsFunc(got.Cards, func(c string) bool { return strings.HasPrefix(got.Chosen, c) })
	})
	poll("explain sampling and the cache credit", `document.getElementById("sampling").textContent + " | " + document.getElementById("legend").textContent`, func(v json.RawMessage) bool {
		var text string
		decode(v, &text)
		return strings.Contains(text, "only while this page is open") && strings.Contains(text, "cost below zero")
	})
	poll("chart the hit rate", `document.querySelectorAll("#c-hit polyline").length`, func(v json.RawMessage) bool { return string(v) == "1" })

	if path := os.Getenv("KVROUTER_UI_SCREENSHOT"); path != "" {
		poll("chart twenty seconds", `(document.querySelector("#c-ttft polyline") || {getAttribute: () => ""}).getAttribute("points").split(" ").length`,
			func(v json.RawMessage) bool { n, _ := strconv.Atoi(string(v)); return n >= 20 })
		png, err := chromedp.Run(bctx, chromedp.FullScreenshot(100))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, png, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	// The drain control: engine 2 leaves routing, then comes back.
	classOf := `document.querySelector('[data-worker-id="2"]').className`
	click := func(sel string) {
		t.Helper()
		if _, err := chromedp.Run(bctx, chromedp.Evaluate[bool](`(b => { if (b) b.click(); return !!b })(document.querySelector('`+sel+`'))`)); err != nil {
			t.Fatal(err)
		}
	}
	click(`[data-worker-id="2"] button[data-act="drain"]`)
	poll("show engine 2 drained", classOf, func(v json.RawMessage) bool { return strings.Contains(string(v), "drained") })
	click(`[data-worker-id="2"] button[data-act="readmit"]`)
	poll("show engine 2 back up", classOf, func(v json.RawMessage) bool { return strings.Contains(string(v), "engine up") })
	noProblems()
	stopConsole()
	<-consoleDone
	stopTraffic()
	wg.Wait()
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}
