// Command image-oci writes kvrouter's container image (internal/image) as
// an OCI image layout and a loadable tarball, with no container runtime:
//
//	CGO_ENABLED=0 go build -trimpath -o build/image/kvrouter ./cmd/kvrouter
//	go run ./scripts/image-oci -binary build/image/kvrouter -layout build/image/oci -tarball build/image/kvrouter.tar
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/kvrouter/kvrouter/internal/image"
)

func main() {
	binary := flag.String("binary", "build/image/kvrouter", "the static kvrouter binary (CGO_ENABLED=0)")
	dir := flag.String("layout", "", "OCI image layout directory to write (replaced)")
	tarPath := flag.String("tarball", "", "image tarball to write, for podman load -i or docker load -i")
	tag := flag.String("tag", "kvrouter:dev", "the image's name and tag")
	flag.Parse()
	if err := run(*binary, *dir, *tarPath, *tag); err != nil {
		fmt.Fprintln(os.Stderr, "image-oci:", err)
		os.Exit(1)
	}
}

func run(binary, dir, tarPath, tag string) error {
	if dir == "" && tarPath == "" {
		return fmt.Errorf("nothing to write: give -layout DIR, -tarball FILE or both")
	}
	img, err := image.Build(binary)
	if err != nil {
		return err
	}
	if dir != "" {
		if err := os.RemoveAll(dir); err != nil {
			return err
		}
		if err := image.WriteLayout(dir, img, tag); err != nil {
			return err
		}
	}
	if tarPath != "" {
		if err := image.WriteTarball(tarPath, img, tag); err != nil {
			return err
		}
	}
	d, err := img.Digest()
	if err != nil {
		return err
	}
	fmt.Printf("%s %s\n", tag, d)
	return nil
}
