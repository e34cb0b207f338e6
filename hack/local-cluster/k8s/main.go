// Command k8s is one multi-call binary for the upstream Kubernetes components that
// hack/local-cluster runs: kube-apiserver, kube-controller-manager, kube-scheduler,
// kubelet, kube-proxy, kubectl and an embedded etcd. It holds no logic of its own: each name calls the
// command constructor that the component's own cmd/<name>/main.go calls, so what runs is
// upstream code at the version in versions.env. One binary links the shared packages once
// (time and disk on a 2-core machine).
//
// The component is chosen by the name it is called by (symlinks made by build.sh) or, when
// called as "k8s", by the first argument: `k8s kubelet --config ...`.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	_ "time/tzdata" // as kube-apiserver's and kube-controller-manager's mains import it

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format, as the mains
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as the mains
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric, as the mains
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

var components = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler": func() *cobra.Command {
		return scheduler.NewSchedulerCommand()
	},
	"kubelet": func() *cobra.Command { return withContext(kubelet.NewKubeletCommand) },
	// Services for pods: the `kubernetes` Service (the API server) and kube-dns (CoreDNS).
	"kube-proxy": proxy.NewProxyCommand,
}

// withContext calls a command constructor that takes a context (kubelet from 1.34 on) or
// none (kubelet up to 1.33), so this one file compiles against every release build.sh
// builds; the constraint keeps it checked at compile time, a third signature fails to build.
func withContext[F func() *cobra.Command | func(context.Context) *cobra.Command](newCommand F) *cobra.Command {
	switch f := any(newCommand).(type) {
	case func(context.Context) *cobra.Command:
		return f(context.Background())
	case func() *cobra.Command:
		return f()
	}
	panic("unreachable: the type constraint admits only the two signatures above")
}

func main() {
	name := filepath.Base(os.Args[0])
	if name == "k8s" {
		if len(os.Args) < 2 {
			usage()
		}
		name = os.Args[1]
		os.Args = append([]string{name}, os.Args[2:]...)
	}
	switch name {
	case "etcd":
		os.Exit(runEtcd(os.Args[1:]))
	case "kubectl":
		command := kubectlcmd.NewDefaultKubectlCommand()
		if err := cli.RunNoErrOutput(command); err != nil {
			kubectlutil.CheckErr(err)
		}
		return
	}
	newCommand, ok := components[name]
	if !ok {
		usage()
	}
	os.Exit(cli.Run(newCommand()))
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: k8s {etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy|kubectl} [flags]")
	os.Exit(2)
}
