#!/usr/bin/env bash
# Builds the kube-apiserver, etcd and helm that the Kubernetes tests run
# (internal/kubetest) into their cache, as the tests would on first use;
# .ci/run starts it early, in the background, so that the build overlaps
# the other checks.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${KVROUTER_KUBETEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvrouter-kubetest}"
version="$(cd internal/kubetest/tools && GOFLAGS=-mod=mod go list -m -f '{{.Version}}' k8s.io/kubernetes)"
helm_version="$(sed -n 's/^const HelmVersion = "\(.*\)"/\1/p' internal/kubetest/kubetest.go)"
mkdir -p "$cache/$version" "$cache/helm-$helm_version"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
start=$(date +%s)
for b in etcd:go.etcd.io/etcd/server/v3 kube-apiserver:k8s.io/kubernetes/cmd/kube-apiserver; do
	name="${b%%:*}" pkg="${b#*:}"
	if [ ! -x "$cache/$version/$name" ]; then
		(cd internal/kubetest/tools && go build -o "$cache/$version/$name.tmp" "$pkg")
		mv "$cache/$version/$name.tmp" "$cache/$version/$name"
	fi
done
if [ ! -x "$cache/helm-$helm_version/helm" ]; then
	GOBIN="$cache/helm-$helm_version" go install "helm.sh/helm/v3/cmd/helm@$helm_version"
fi
echo "kubetest binaries ready in $cache ($(( $(date +%s) - start )) s)"
