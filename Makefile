GO ?= go

.PHONY: test fmt-check vet race build bench-index fuzz

# test is what CI runs (.ci/run): formatting, vet, then every test with the
# race detector.
test: fmt-check vet race

fmt-check:
	@files="$$(gofmt -l .)"; \
	if [ -n "$$files" ]; then \
		echo "gofmt: these files need formatting (run gofmt -w .):"; \
		echo "$$files"; \
		exit 1; \
	fi

vet:
	$(GO) vet ./...

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
