package main

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/spf13/cobra"
)

// version is set at link time: -ldflags "-X main.version=v1.2.3".
var version = "dev"

func versionString() string {
	bi, _ := debug.ReadBuildInfo()
	return describeVersion(version, bi, runtime.Version())
}

// describeVersion names the build: the linked-in version, else the module
// version "go install ...@v1.2.3" records, followed by the commit it was
// built from (with -dirty for uncommitted changes) when the build
// recorded it, and the Go release.
func describeVersion(linked string, bi *debug.BuildInfo, goVersion string) string {
	v, rev, dirty := linked, "", false
	if bi != nil {
		if v == "dev" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			v = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
	}
	if rev != "" {
		if len(rev) > 12 {
			rev = rev[:12]
		}
		// A build from a checkout stamps a pseudo-version made of the
		// commit ("v0.0.0-20261124135139-4cb141be8447+dirty"), which says
		// no more than the revision that follows.
		if strings.HasPrefix(v, "v0.0.0-") && strings.Contains(v, rev) {
			v = "dev"
		}
		v += " (" + rev
		if dirty {
			v += "-dirty"
		}
		v += ")"
	}
	return fmt.Sprintf("kvrouter %s %s %s/%s", v, goVersion, runtime.GOOS, runtime.GOARCH)
}

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Args:  cobra.NoArgs,
		Run: func(cmd *cobra.Command, _ []string) {
			fmt.Fprintln(cmd.OutOrStdout(), versionString())
		},
	}
}
