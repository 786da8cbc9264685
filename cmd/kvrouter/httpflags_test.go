package main

import (
	"os"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

func TestHTTPFlagsFromEnvironment(t *testing.T) {
	for _, tc := range []struct {
		env            map[string]string
		args           []string
		key, admin     string
		timeout        time.Duration
		timeoutRefused bool
	}{
		{env: map[string]string{}, timeout: 30 * time.Second},
		{env: map[string]string{"VLLM_API_KEY": "v"}, key: "v", timeout: 30 * time.Second},
		{env: map[string]string{"VLLM_API_KEY": "v", "DYN_API_KEY": "d", "DYN_ADMIN_TOKEN": "a"}, key: "d", admin: "a", timeout: 30 * time.Second},
		{env: map[string]string{"VLLM_API_KEY": "v"}, args: []string{"--api-key", "f", "--shutdown-timeout", "2.5"}, key: "f", timeout: 2500 * time.Millisecond},
		{env: map[string]string{"DYN_SHUTDOWN_TIMEOUT": "-1"}, timeoutRefused: true},
	} {
		t.Run("", func(t *testing.T) {
			for _, k := range []string{"VLLM_API_KEY", "DYN_API_KEY", "DYN_ADMIN_TOKEN", "DYN_SHUTDOWN_TIMEOUT"} {
				t.Setenv(k, tc.env[k]) // restored after the test
				if _, ok := tc.env[k]; !ok {
					os.Unsetenv(k)
				}
			}
			var hf httpFlags
			fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
			hf.register(fs)
			if err := fs.Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			if err := applyEnv(fs); err != nil {
				t.Fatal(err)
			}
			timeout, err := hf.timeout()
			if tc.timeoutRefused {
				if err == nil {
					t.Fatal("a negative --shutdown-timeout was accepted")
				}
				return
			}
			if err != nil || timeout != tc.timeout || hf.access.APIKey != tc.key || hf.access.AdminToken != tc.admin {
				t.Fatalf("key %q admin %q timeout %v (%v), want %q %q %v", hf.access.APIKey, hf.access.AdminToken, timeout, err, tc.key, tc.admin, tc.timeout)
			}
		})
	}
}
