package main

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// suggestFlag adds "did you mean --x?" to an unknown flag's error: cobra
// suggests subcommands by edit distance but not flags, and `up --worker 2`
// for `--workers 2` would otherwise end at "unknown flag".
func suggestFlag(cmd *cobra.Command, err error) error {
	msg := err.Error()
	name, ok := strings.CutPrefix(msg, "unknown flag: --")
	if !ok {
		return err
	}
	if s := closestFlag(cmd.Flags(), name); s != "" {
		return fmt.Errorf("%w\ndid you mean --%s? (kvrouter %s --help lists the flags)", err, s, cmd.Name())
	}
	return err
}

// closestFlag is the visible flag nearest to name: one it is a prefix of
// (or that is a prefix of it), else the nearest within 2 edits; "" when
// none is near or two are equally near.
func closestFlag(fs *pflag.FlagSet, name string) string {
	best, bestDist, tie := "", 3, false
	fs.VisitAll(func(f *pflag.Flag) {
		if f.Hidden || f.Deprecated != "" {
			return
		}
		d := editDistance(name, f.Name)
		if len(name) >= 3 && (strings.HasPrefix(f.Name, name) || strings.HasPrefix(name, f.Name)) {
			d = min(d, 1)
		}
		switch {
		case d < bestDist:
			best, bestDist, tie = f.Name, d, false
		case d == bestDist:
			tie = true
		}
	})
	if tie {
		return ""
	}
	return best
}

// editDistance is the Levenshtein distance of a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
