//go:build tools

// Package tools pins the Kubernetes control plane used by the tests that need
// a real API server; it is a module of its own so that the main module does
// not depend on k8s.io/kubernetes.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
)
