// Command coredns is CoreDNS with only the plugins the local cluster's DNS needs, so that
// build.sh compiles a small part of it (the full plugin set pulls the AWS, Azure, GCP,
// etcd and DataDog SDKs): the cluster's Corefile (cluster.py) uses bind, errors, health,
// ready, kubernetes and cache. No forward or loop: the cluster has no upstream resolver to
// forward to (no internet), so names outside cluster.local get no answer here.
//
// Each plugin registers itself in its package's init; the order the plugins run in is
// CoreDNS's own directive list (core/dnsserver/zdirectives.go), not the import order.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	coremain.Run()
}
