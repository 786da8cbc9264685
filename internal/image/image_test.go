package image

import (
	"archive/tar"
	"bufio"
	"encoding/json"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// containerfile is what the Containerfile says of the image.
type containerfile struct {
	from, user  string
	copies      [][2]string // source, destination
	entrypoint  []string
	cmd         []string
	exposed     []string
	instruction []string // every instruction, in order
}

// parseContainerfile reads the instructions kvrouter's Containerfile uses;
// any other is an error, so that one added there is added here too.
func parseContainerfile(t *testing.T, path string) containerfile {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var c containerfile
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		op, arg, _ := strings.Cut(line, " ")
		op = strings.ToUpper(op)
		arg = strings.TrimSpace(arg)
		c.instruction = append(c.instruction, op)
		execForm := func() []string {
			var v []string
			if err := json.Unmarshal([]byte(arg), &v); err != nil {
				t.Fatalf("%s %s: want the exec (JSON) form: %v", op, arg, err)
			}
			return v
		}
		switch op {
		case "FROM":
			c.from = arg
		case "COPY":
			f := strings.Fields(arg)
			if len(f) != 2 {
				t.Fatalf("COPY %s: want one source and one destination", arg)
			}
			c.copies = append(c.copies, [2]string{f[0], f[1]})
		case "USER":
			c.user = arg
		case "EXPOSE":
			for _, p := range strings.Fields(arg) {
				if !strings.Contains(p, "/") {
					p += "/tcp"
				}
				c.exposed = append(c.exposed, p)
			}
		case "ENTRYPOINT":
			c.entrypoint = execForm()
		case "CMD":
			c.cmd = execForm()
		default:
			t.Fatalf("Containerfile instruction %s: not one the image builder knows (internal/image)", op)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return c
}

// The Containerfile and the Go builder describe the same image.
func TestContainerfileAgrees(t *testing.T) {
	c := parseContainerfile(t, filepath.Join("..", "..", "Containerfile"))
	if c.from != "scratch" {
		t.Errorf("FROM %s, want scratch: the builder puts the binary on an empty base", c.from)
	}
	if want := [][2]string{{"kvrouter", Path}}; !slices.Equal(c.copies, want) {
		t.Errorf("COPY %v, want %v only", c.copies, want)
	}
	if c.user != User {
		t.Errorf("USER %s, builder %s", c.user, User)
	}
	if !slices.Equal(c.entrypoint, []string{Path}) {
		t.Errorf("ENTRYPOINT %q, builder [%s]", c.entrypoint, Path)
	}
	if !slices.Equal(c.cmd, Cmd) {
		t.Errorf("CMD %q, builder %q", c.cmd, Cmd)
	}
	if got, want := slices.Sorted(slices.Values(c.exposed)), slices.Sorted(slices.Values(Ports)); !slices.Equal(got, want) {
		t.Errorf("EXPOSE %v, builder %v", got, want)
	}
}

// buildKvrouter builds the binary as make image does.
func buildKvrouter(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "kvrouter")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", out, "./cmd/kvrouter")
	cmd.Dir = filepath.Join("..", "..")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, b)
	}
	return out
}

// TestImage builds the image around a static kvrouter, writes it as an OCI
// layout and a tarball, reads both back, and checks its config and its
// filesystem: the one binary, static, runnable, and no shell.
func TestImage(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the image's binary is a Linux executable")
	}
	bin := buildKvrouter(t)
	img, err := Build(bin)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "oci")
	if err := WriteLayout(dir, img, "kvrouter:test"); err != nil {
		t.Fatal(err)
	}
	tarPath := filepath.Join(t.TempDir(), "kvrouter.tar")
	if err := WriteTarball(tarPath, img, "kvrouter:test"); err != nil {
		t.Fatal(err)
	}
	want, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}

	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 1 || im.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "kvrouter:test" {
		t.Fatalf("layout index: %+v, want one image named kvrouter:test", im.Manifests)
	}
	fromLayout, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	fromTar, err := tarball.ImageFromPath(tarPath, nil)
	if err != nil {
		t.Fatal(err)
	}
	for name, got := range map[string]v1.Image{"layout": fromLayout, "tarball": fromTar} {
		cf, err := got.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		checkConfig(t, name, cf)
	}
	if d, _ := fromLayout.Digest(); d != want {
		t.Errorf("layout's image digest %s, built %s", d, want)
	}
	again, err := Build(bin)
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := again.Digest(); d != want {
		t.Errorf("the same binary built to %s, then %s: the image is not reproducible", want, d)
	}

	files := extract(t, fromTar)
	if got := slices.Sorted(maps.Keys(files)); !slices.Equal(got, []string{"kvrouter"}) {
		t.Fatalf("image filesystem %v, want kvrouter alone (no shell, no libc)", got)
	}
	kv := files["kvrouter"]
	if kv.hdr.Mode&0o111 == 0 || kv.hdr.Uid != 0 || kv.hdr.Mode&0o022 != 0 {
		t.Errorf("/kvrouter mode %o uid %d: want executable, owned by root, not writable by the user it runs as", kv.hdr.Mode, kv.hdr.Uid)
	}
	if _, err := StaticArch(kv.body); err != nil {
		t.Fatalf("/kvrouter in the layer: %v", err)
	}
	run := filepath.Join(t.TempDir(), "kvrouter")
	if err := os.WriteFile(run, kv.body, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(run, "version").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(out), "kvrouter ") {
		t.Fatalf("/kvrouter version from the layer: %v: %s", err, out)
	}
}

func checkConfig(t *testing.T, from string, cf *v1.ConfigFile) {
	t.Helper()
	c := cf.Config
	if !slices.Equal(c.Entrypoint, []string{"/kvrouter"}) || !slices.Equal(c.Cmd, []string{"serve"}) {
		t.Errorf("%s: entrypoint %q cmd %q, want [/kvrouter] [serve]", from, c.Entrypoint, c.Cmd)
	}
	uid, gid, ok := strings.Cut(c.User, ":")
	if n, err := strconv.Atoi(uid); err != nil || n == 0 || !ok {
		t.Errorf("%s: user %q, want a numeric non-root uid:gid (a name needs /etc/passwd, which the image has not)", from, c.User)
	}
	if n, err := strconv.Atoi(gid); err != nil || n == 0 {
		t.Errorf("%s: group of %q, want a numeric non-root gid", from, c.User)
	}
	if got := slices.Sorted(maps.Keys(c.ExposedPorts)); !slices.Equal(got, []string{"4222/tcp", "8000/tcp", "9002/tcp"}) {
		t.Errorf("%s: exposed ports %v, want 4222, 8000 and 9002", from, got)
	}
	if cf.OS != "linux" || cf.Architecture != runtime.GOARCH {
		t.Errorf("%s: platform %s/%s, want linux/%s", from, cf.OS, cf.Architecture, runtime.GOARCH)
	}
}

type file struct {
	hdr  *tar.Header
	body []byte
}

// extract reads the image's flattened filesystem.
func extract(t *testing.T, img v1.Image) map[string]file {
	t.Helper()
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	out := map[string]file{}
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out[strings.TrimPrefix(hdr.Name, "/")] = file{hdr: hdr, body: b}
	}
}

// A binary that needs a loader is refused: it would not start on an empty
// base.
func TestBuildRefusesDynamicBinary(t *testing.T) {
	for _, p := range []string{"/bin/true", "/usr/bin/true"} {
		if _, err := os.Stat(p); err != nil {
			continue
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := StaticArch(b); err == nil {
			t.Skipf("%s is static here", p)
		}
		if _, err := Build(p); err == nil || !strings.Contains(err.Error(), "CGO_ENABLED=0") {
			t.Fatalf("Build(%s): %v, want a refusal naming CGO_ENABLED=0", p, err)
		}
		return
	}
	t.Skip("no /bin/true")
}
