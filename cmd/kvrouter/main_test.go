package main

import (
	"os"
	"testing"
)

// cliEnv makes the test binary the kvrouter command line tool, for the
// child processes that commands under test start (bench overhead's
// engines run `kvrouter mocker`, the binary found by os.Executable).
const cliEnv = "KVROUTER_TEST_AS_CLI"

func TestMain(m *testing.M) {
	if os.Getenv(cliEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}
