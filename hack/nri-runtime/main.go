// nri-runtime runs NRI's own runtime side (github.com/containerd/nri/pkg/adaptation, the
// code containerd links) on a socket of our choosing, so that tests drive the driver's NRI
// plugin against the real protocol implementation instead of only against a Python fake.
//
//	nri-runtime -socket PATH            runtime: JSON commands on stdin, JSON lines on stdout
//	nri-runtime -socket PATH -validator [-required a,b]
//	                                    the same with NRI's default validator on, as
//	                                    containerd's [plugins.'io.containerd.nri.v1.nri'.default_validator]
//	                                    enable = true, required_plugins = [a, b] sets it up
//	nri-runtime -socket PATH -plugin    a minimal plugin built on NRI's stub (for recordings)
//
// Runtime commands, one JSON object per line:
//
//	{"op":"add","pod":POD}     the runtime knows POD (sent at the next Synchronize), no event
//	{"op":"run","pod":POD}     RunPodSandbox (POD is added first)
//	{"op":"stop","id":ID}      StopPodSandbox
//	{"op":"remove","id":ID}    RemovePodSandbox (POD is forgotten)
//	{"op":"create","id":ID,"container":NAME}  CreateContainer of NAME in pod ID
//
// POD is {"id","name","uid","namespace","netns","annotations"}. Each command answers one line:
// {"op":..., "ms": handling time, "error": "..." when the plugins failed it}. A plugin's
// synchronization prints {"event":"synchronized","pods":N}.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/containerd/nri/pkg/adaptation"
	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
	validator "github.com/containerd/nri/plugins/default-validator/builtin"
)

type pod struct {
	ID        string `json:"id"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
	Namespace string `json:"namespace"`
	Netns     string `json:"netns"`
	// Annotations as the kubelet passes the pod's to the runtime (NRI's default validator
	// reads required-plugins.noderesource.dev/... there).
	Annotations map[string]string `json:"annotations"`
}

type command struct {
	Op  string `json:"op"`
	Pod pod    `json:"pod"`
	ID  string `json:"id"`
	// Container: the container's name for "create".
	Container string `json:"container"`
}

var (
	outLock sync.Mutex
	pods    = map[string]*api.PodSandbox{}
	podLock sync.Mutex
)

func emit(v map[string]any) {
	outLock.Lock()
	defer outLock.Unlock()
	line, _ := json.Marshal(v)
	fmt.Println(string(line))
}

func sandbox(p pod) *api.PodSandbox {
	return &api.PodSandbox{
		Id: p.ID, Name: p.Name, Uid: p.UID, Namespace: p.Namespace, Annotations: p.Annotations,
		Linux: &api.LinuxPodSandbox{
			Namespaces: []*api.LinuxNamespace{{Type: "network", Path: p.Netns}},
		},
	}
}

func runtime(socket string, validate bool, required []string) error {
	syncFn := func(ctx context.Context, cb adaptation.SyncCB) error {
		podLock.Lock()
		list := make([]*api.PodSandbox, 0, len(pods))
		for _, p := range pods {
			list = append(list, p)
		}
		podLock.Unlock()
		_, err := cb(ctx, list, nil)
		result := map[string]any{"event": "synchronized", "pods": len(list)}
		if err != nil {
			result["error"] = err.Error()
		}
		emit(result)
		return err
	}
	updateFn := func(context.Context, []*api.ContainerUpdate) ([]*api.ContainerUpdate, error) {
		return nil, nil
	}
	options := []adaptation.Option{
		adaptation.WithSocketPath(socket), adaptation.WithPluginPath(os.DevNull + ".none"),
		adaptation.WithPluginConfigPath(os.DevNull + ".none"),
	}
	if validate {
		options = append(options, adaptation.WithDefaultValidator(&validator.DefaultValidatorConfig{
			Enable: true, RequiredPlugins: required,
		}))
	}
	r, err := adaptation.New("nri-runtime", "v0.12.3", syncFn, updateFn, options...)
	if err != nil {
		return err
	}
	if err := r.Start(); err != nil {
		return err
	}
	defer r.Stop()
	emit(map[string]any{"event": "listening", "socket": socket})

	scanner := bufio.NewScanner(os.Stdin)
	for scanner.Scan() {
		var c command
		if err := json.Unmarshal(scanner.Bytes(), &c); err != nil {
			emit(map[string]any{"error": fmt.Sprintf("bad command: %v", err)})
			continue
		}
		ctx := context.Background()
		start := time.Now()
		var err error
		switch c.Op {
		case "add", "run":
			sb := sandbox(c.Pod)
			podLock.Lock()
			pods[sb.Id] = sb
			podLock.Unlock()
			if c.Op == "run" {
				err = r.RunPodSandbox(ctx, &api.RunPodSandboxRequest{Pod: sb})
			}
		case "create":
			podLock.Lock()
			sb := pods[c.ID]
			podLock.Unlock()
			if sb == nil {
				err = fmt.Errorf("no pod %q", c.ID)
				break
			}
			_, err = r.CreateContainer(ctx, &api.CreateContainerRequest{Pod: sb, Container: &api.Container{
				Id: c.ID + "-" + c.Container, PodSandboxId: c.ID, Name: c.Container,
				State: api.ContainerState_CONTAINER_CREATED,
			}})
		case "stop", "remove":
			podLock.Lock()
			sb := pods[c.ID]
			if c.Op == "remove" {
				delete(pods, c.ID)
			}
			podLock.Unlock()
			if sb == nil {
				err = fmt.Errorf("no pod %q", c.ID)
			} else if c.Op == "stop" {
				err = r.StopPodSandbox(ctx, &api.StopPodSandboxRequest{Pod: sb})
			} else {
				err = r.RemovePodSandbox(ctx, &api.RemovePodSandboxRequest{Pod: sb})
			}
		default:
			err = fmt.Errorf("unknown op %q", c.Op)
		}
		result := map[string]any{"op": c.Op, "ms": float64(time.Since(start).Microseconds()) / 1000}
		if err != nil {
			result["error"] = err.Error()
		}
		emit(result)
	}
	return scanner.Err()
}

type recorder struct{}

func (recorder) RunPodSandbox(_ context.Context, p *api.PodSandbox) error {
	emit(map[string]any{"event": "RunPodSandbox", "id": p.Id})
	return nil
}

func plugin(socket string) error {
	s, err := stub.New(recorder{}, stub.WithSocketPath(socket),
		stub.WithPluginName("recorder"), stub.WithPluginIdx("10"))
	if err != nil {
		return err
	}
	return s.Run(context.Background())
}

func main() {
	socket := flag.String("socket", api.DefaultSocketPath, "NRI socket")
	asPlugin := flag.Bool("plugin", false, "run a minimal NRI stub plugin instead of the runtime")
	validate := flag.Bool("validator", false, "turn NRI's default validator on")
	required := flag.String("required", "", "the validator's required plugins, comma-separated")
	flag.Parse()
	var err error
	if *asPlugin {
		err = plugin(*socket)
	} else {
		var names []string
		if *required != "" {
			names = strings.Split(*required, ",")
		}
		err = runtime(*socket, *validate, names)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "nri-runtime:", err)
		os.Exit(1)
	}
}
