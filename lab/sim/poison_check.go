//go:build simcheck

package sim

import "os"

// A build with -tags simcheck fills the skipped blocks of every run's
// trace prompts as KVROUTER_SIM_SKIPPED says (generate, poison or
// scramble), so that any run of the command can be checked to give the
// results of one that generates every token.
func init() {
	switch os.Getenv("KVROUTER_SIM_SKIPPED") {
	case "generate":
		defaultSkipped = generateSkipped
	case "poison":
		defaultSkipped = poisonSkipped
	case "scramble":
		defaultSkipped = scrambleSkipped
	}
}
