GO ?= go

.PHONY: test fmt-check vet lint race build bench-index fuzz image image-oci

# test is what CI runs (.ci/run): formatting, vet, staticcheck, then every
# test with the race detector.
test: fmt-check vet lint race

fmt-check:
	@files="$$(gofmt -l .)"; \
	if [ -n "$$files" ]; then \
		echo "gofmt: these files need formatting (run gofmt -w .):"; \
		echo "$$files"; \
		exit 1; \
	fi

vet:
	$(GO) vet ./...

# staticcheck at a pinned version, fetched through the module proxy on
# first use: it finds what vet does not (dead code, results never checked).
STATICCHECK ?= honnef.co/go/tools/cmd/staticcheck@v0.8.2
lint:
	$(GO) run $(STATICCHECK) ./...

race:
	$(GO) test -race ./...

build:
	$(GO) build -buildvcs=auto -o bin/kvrouter ./cmd/kvrouter

TRACE ?= ../shared/traces/mooncake_conversation.jsonl

bench-index:
	$(GO) run ./cmd/kvrouter bench index --trace $(TRACE) --workers 1000 --duration 20s --json

# fuzz runs every fuzz target for FUZZTIME each (scripts/fuzz.sh).
FUZZTIME ?= 60s
fuzz:
	FUZZTIME=$(FUZZTIME) scripts/fuzz.sh

# image builds the container image (Containerfile) with podman, else
# buildah (Debian packages both): the static binary is built here, so
# FROM scratch needs no registry.
IMAGE ?= kvrouter:dev
image:
	mkdir -p build/image
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o build/image/kvrouter ./cmd/kvrouter
	if command -v podman >/dev/null 2>&1; then podman build -f Containerfile -t $(IMAGE) build/image; \
	else buildah bud -f Containerfile -t $(IMAGE) build/image; fi

# image-oci writes the same image with no container runtime (internal/image,
# go-containerregistry): an OCI image layout in build/image/oci and a
# tarball for podman load -i or docker load -i.
image-oci:
	mkdir -p build/image
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o build/image/kvrouter ./cmd/kvrouter
	$(GO) run ./scripts/image-oci -binary build/image/kvrouter -layout build/image/oci -tarball build/image/kvrouter.tar -tag $(IMAGE)
