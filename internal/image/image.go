// Package image assembles kvrouter's container image, the one the
// Containerfile describes, without a container runtime: one layer holding
// the static binary at /kvrouter on an empty base, run as a non-root user.
// It writes the image as an OCI image layout and as a tarball that
// `podman load` and `docker load` read. The same binary and the same
// timestamps give the same digest.
package image

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// The image's configuration; the Containerfile says the same (a test
// holds them together).
const (
	// Path is where the binary lies, and the entrypoint.
	Path = "/kvrouter"
	// User is the uid:gid it runs as: 65532, the "nonroot" of distroless
	// images.
	User = "65532:65532"
)

// Cmd is the default argument; Ports are those exposed: the OpenAI
// frontend with /live, /ready and /metrics, the endpoint picker's
// ext_proc, the embedded NATS server.
var (
	Cmd   = []string{"serve"}
	Ports = []string{"8000/tcp", "9002/tcp", "4222/tcp"}
)

// Build makes the image around the binary at path, which must be a
// statically linked Linux ELF executable: the image has no libc, no
// loader and no shell. Its architecture is the binary's.
func Build(path string) (v1.Image, error) {
	bin, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	arch, err := StaticArch(bin)
	if err != nil {
		return nil, fmt.Errorf("image: %s: %w", path, err)
	}
	layerTar, err := singleFile(Path[1:], bin)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer),
		// Digest, size and every write read the compressed layer: without
		// the cache each compresses the whole binary anew.
		tarball.WithCompressedCaching)
	if err != nil {
		return nil, fmt.Errorf("image: layer: %w", err)
	}
	base := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", arch
	cf.Created = v1.Time{Time: time.Unix(0, 0).UTC()}
	cf.Config.User = User
	cf.Config.Entrypoint = []string{Path}
	cf.Config.Cmd = Cmd
	cf.Config.ExposedPorts = map[string]struct{}{}
	for _, p := range Ports {
		cf.Config.ExposedPorts[p] = struct{}{}
	}
	return mutate.ConfigFile(img, cf)
}

// singleFile is a layer's tar holding one executable file owned by root,
// so that the user the image runs as cannot change it.
func singleFile(name string, b []byte) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	hdr := &tar.Header{Name: name, Mode: 0o755, Size: int64(len(b)), Typeflag: tar.TypeReg, ModTime: time.Unix(0, 0), Format: tar.FormatPAX}
	if err := tw.WriteHeader(hdr); err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	if _, err := tw.Write(b); err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	return buf.Bytes(), nil
}

// StaticArch returns the OCI architecture of a statically linked Linux
// executable, and an error for anything else: a binary that needs a
// dynamic loader or shared libraries cannot run on an empty base.
func StaticArch(bin []byte) (string, error) {
	f, err := elf.NewFile(bytes.NewReader(bin))
	if err != nil {
		return "", fmt.Errorf("not an ELF executable: %w", err)
	}
	defer f.Close()
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return "", fmt.Errorf("ELF type %v is not an executable", f.Type)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return "", errors.New("dynamically linked (it names a program interpreter): build it with CGO_ENABLED=0")
		}
	}
	if libs, err := f.ImportedLibraries(); err == nil && len(libs) > 0 {
		return "", fmt.Errorf("needs shared libraries %v: build it with CGO_ENABLED=0", libs)
	}
	arch, ok := map[elf.Machine]string{elf.EM_X86_64: "amd64", elf.EM_AARCH64: "arm64", elf.EM_PPC64: "ppc64le", elf.EM_S390: "s390x", elf.EM_RISCV: "riscv64"}[f.Machine]
	if !ok {
		return "", fmt.Errorf("ELF machine %v has no OCI architecture here", f.Machine)
	}
	return arch, nil
}

// WriteLayout writes img as an OCI image layout in dir (made, or added
// to), its reference name tag.
func WriteLayout(dir string, img v1.Image, tag string) error {
	p, err := layout.FromPath(dir)
	if err != nil {
		if p, err = layout.Write(dir, empty.Index); err != nil {
			return fmt.Errorf("image: %w", err)
		}
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": tag})); err != nil {
		return fmt.Errorf("image: %w", err)
	}
	return nil
}

// WriteTarball writes img tagged tag as the tarball `podman load -i` and
// `docker load -i` read.
func WriteTarball(path string, img v1.Image, tag string) error {
	t, err := name.NewTag(tag)
	if err != nil {
		return fmt.Errorf("image: tag %q: %w", tag, err)
	}
	if err := tarball.WriteToFile(path, t, img); err != nil {
		return fmt.Errorf("image: %w", err)
	}
	return nil
}
