// Command kvrouter is the KV-cache-aware router for LLM inference and its
// tools. Every subcommand lives in its own file and is registered in
// root.go.
package main

import "os"

func main() {
	if err := newRootCmd().Execute(); err != nil {
		os.Exit(1)
	}
}
