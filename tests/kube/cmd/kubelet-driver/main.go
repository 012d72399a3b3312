// Command kubelet-driver is the node side of gpuvisor's Kubernetes tests: it stands in for a
// kubelet where no kubelet can run (cgroup v1, no systemd, no container runtime; see
// docs/kubernetes.md), but every DRA step is the kubelet's own code: the plugin manager
// (pkg/kubelet/pluginmanager) watches the registration directory and validates and registers
// the DRA plugin with the DRA manager's handler (pkg/kubelet/cm/dra), which chooses the gRPC
// service, applies the 45 s call timeout, opens the health stream, checkpoints prepared claims
// in its state directory and reads ResourceClaims from the API server.
//
// Around it, a small pod loop does what the kubelet's pod workers do for DRA: a pod bound to
// the node is prepared (PrepareResources, then GetResources for each container's CDI ids) and
// marked Running; a pod with a deletion timestamp, or one that vanished from the API server
// (a force delete), is unprepared (UnprepareResources, retried every second while it fails, as
// the kubelet does) and then deleted with grace period 0. No container is started: what holds
// a device in the tests is started by the tests.
//
// The Node object is created Ready with a capacity, and kept Ready by a node lease heartbeat.
//
// It prints one JSON object per line on stdout for the tests to synchronise on:
// {"event":"registered","driver":...,"services":[...]}, "prepared" (pod, cdi, prepare_ms: how long the
// kubelet's PrepareResources took), "prepare_failed"
// (pod, error), "unprepared" (pod), "unprepare_failed" (pod, error), "health" (pod, status).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	plugincache "k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
	"k8s.io/utils/ptr"
)

var out = struct {
	sync.Mutex
	enc *json.Encoder
}{enc: json.NewEncoder(os.Stdout)}

func emit(ev map[string]any) {
	out.Lock()
	defer out.Unlock()
	ev["time"] = time.Now().UTC().Format(time.RFC3339Nano)
	_ = out.enc.Encode(ev)
}

// handler wraps the DRA manager's plugin handler to report registrations.
// handler passes registrations to the kubelet's DRA handler and reports them. With `only`
// set, it acts as an older kubelet: of the plugin's DRAPlugin services, it passes only those.
type handler struct {
	inner plugincache.PluginHandler
	only  []string
}

func (h handler) known(versions []string) []string {
	if len(h.only) == 0 {
		return versions
	}
	var out []string
	for _, v := range versions {
		if !strings.HasSuffix(v, ".DRAPlugin") || slices.Contains(h.only, v) {
			out = append(out, v)
		}
	}
	return out
}

func (h handler) ValidatePlugin(ctx context.Context, name, endpoint string, versions []string) error {
	versions = h.known(versions)
	err := h.inner.ValidatePlugin(ctx, name, endpoint, versions)
	if err != nil {
		emit(map[string]any{"event": "validate_failed", "driver": name, "services": versions, "error": err.Error()})
	}
	return err
}

func (h handler) RegisterPlugin(ctx context.Context, name, endpoint string, versions []string, timeout *time.Duration) error {
	versions = h.known(versions)
	err := h.inner.RegisterPlugin(ctx, name, endpoint, versions, timeout)
	ev := map[string]any{"event": "registered", "driver": name, "endpoint": endpoint, "services": versions}
	if err != nil {
		ev["event"] = "register_failed"
		ev["error"] = err.Error()
	}
	emit(ev)
	return err
}

func (h handler) DeRegisterPlugin(ctx context.Context, name, endpoint string) {
	h.inner.DeRegisterPlugin(ctx, name, endpoint)
	emit(map[string]any{"event": "deregistered", "driver": name, "endpoint": endpoint})
}

type podState int

const (
	podPending podState = iota
	podRunning
	podGone
)

type driver struct {
	client   kubernetes.Interface
	node     string
	dra      *dra.Manager
	mu       sync.Mutex
	pods     map[types.UID]*v1.Pod // every pod of this node the loop knows, until unprepared
	state    map[types.UID]podState
	busy     sets.Set[types.UID]
	wakeup   chan struct{}
	retry    time.Duration
	capacity v1.ResourceList
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server")
	node := flag.String("node", "", "the Node's name")
	root := flag.String("root", "", "the kubelet root: plugins_registry/ and the DRA manager's state live here")
	only := flag.String("dra-services", "", "act as an older kubelet: the DRAPlugin services it knows (comma-separated, e.g. v1beta1.DRAPlugin)")
	flag.Parse()
	if *kubeconfig == "" || *node == "" || *root == "" {
		fmt.Fprintln(os.Stderr, "usage: kubelet-driver --kubeconfig FILE --node NAME --root DIR [--dra-services LIST]")
		os.Exit(2)
	}
	klog.InitFlags(nil)
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	var known []string
	if *only != "" {
		known = strings.Split(*only, ",")
	}
	if err := run(ctx, *kubeconfig, *node, *root, known); err != nil {
		fmt.Fprintln(os.Stderr, "kubelet-driver:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, kubeconfig, node, root string, known []string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	cfg.QPS, cfg.Burst = 200, 400
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	registry := filepath.Join(root, "plugins_registry")
	stateDir := filepath.Join(root, "state")
	for _, d := range []string{registry, stateDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return err
		}
	}
	d := &driver{
		client: client, node: node,
		pods: map[types.UID]*v1.Pod{}, state: map[types.UID]podState{}, busy: sets.New[types.UID](),
		wakeup: make(chan struct{}, 1), retry: time.Second,
		capacity: v1.ResourceList{
			v1.ResourceCPU: resource.MustParse("64"), v1.ResourceMemory: resource.MustParse("256Gi"),
			v1.ResourcePods: resource.MustParse("250"),
		},
	}
	if err := d.registerNode(ctx); err != nil {
		return fmt.Errorf("register node: %w", err)
	}
	go d.heartbeat(ctx)

	logger := klog.FromContext(ctx)
	d.dra, err = dra.NewManager(logger, client, stateDir)
	if err != nil {
		return err
	}
	ready := config.NewSourcesReady(func(sets.Set[string]) bool { return true })
	getNode := func(ctx context.Context) (*v1.Node, error) {
		return client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	}
	if err := d.dra.Start(ctx, d.activePods, getNode, ready); err != nil {
		return err
	}
	defer d.dra.Stop()
	go d.healthUpdates(ctx)

	broadcaster := record.NewBroadcaster()
	recorder := broadcaster.NewRecorder(nil, v1.EventSource{Component: "kubelet-driver", Host: node})
	pm := pluginmanager.NewPluginManager(registry, recorder)
	pm.AddHandler("DRAPlugin", handler{inner: d.dra.GetWatcherHandler(), only: known})
	pmStop := make(chan struct{})
	go pm.Run(ctx, ready, pmStop)
	defer close(pmStop)

	factory := informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
		}))
	podInformer := factory.Core().V1().Pods().Informer()
	_, _ = podInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { d.seen(obj, false) },
		UpdateFunc: func(_, obj any) { d.seen(obj, false) },
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			d.seen(obj, true)
		},
	})
	factory.Start(ctx.Done())
	factory.WaitForCacheSync(ctx.Done())
	emit(map[string]any{"event": "started", "node": node})
	d.loop(ctx)
	return nil
}

func (d *driver) registerNode(ctx context.Context) error {
	n := &v1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: d.node, Labels: map[string]string{"kubernetes.io/hostname": d.node, "kubernetes.io/os": "linux"}},
	}
	_, err := d.client.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return d.nodeStatus(ctx)
}

func (d *driver) nodeStatus(ctx context.Context) error {
	n, err := d.client.CoreV1().Nodes().Get(ctx, d.node, metav1.GetOptions{})
	if err != nil {
		return err
	}
	now := metav1.Now()
	n.Status.Capacity = d.capacity
	n.Status.Allocatable = d.capacity
	n.Status.Conditions = []v1.NodeCondition{{
		Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady",
		Message: "kubelet-driver (gpuvisor tests) is posting ready status", LastHeartbeatTime: now, LastTransitionTime: now,
	}}
	n, err = d.client.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{})
	if err != nil {
		return err
	}
	// The API server's TaintNodesByCondition admission taints a new Node
	// node.kubernetes.io/not-ready:NoSchedule; the node lifecycle controller, which would
	// lift it once the node is Ready, does not run in the test control plane.
	kept := n.Spec.Taints[:0]
	for _, t := range n.Spec.Taints {
		if t.Key != v1.TaintNodeNotReady {
			kept = append(kept, t)
		}
	}
	if len(kept) != len(n.Spec.Taints) {
		n.Spec.Taints = kept
		_, err = d.client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{})
	}
	return err
}

// heartbeat renews the node's lease every 10 s (what the node lifecycle controller watches).
func (d *driver) heartbeat(ctx context.Context) {
	leases := d.client.CoordinationV1().Leases(v1.NamespaceNodeLease)
	for {
		now := metav1.NewMicroTime(time.Now())
		l, err := leases.Get(ctx, d.node, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			_, err = leases.Create(ctx, &coordinationv1.Lease{
				ObjectMeta: metav1.ObjectMeta{Name: d.node},
				Spec:       coordinationv1.LeaseSpec{HolderIdentity: ptr.To(d.node), LeaseDurationSeconds: ptr.To[int32](40), RenewTime: &now},
			}, metav1.CreateOptions{})
		case err == nil:
			l.Spec.RenewTime = &now
			_, err = leases.Update(ctx, l, metav1.UpdateOptions{})
		}
		if err != nil && ctx.Err() == nil {
			fmt.Fprintln(os.Stderr, "kubelet-driver: node lease:", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(10 * time.Second):
		}
	}
}

func (d *driver) activePods() []*v1.Pod {
	d.mu.Lock()
	defer d.mu.Unlock()
	var pods []*v1.Pod
	for uid, p := range d.pods {
		if d.state[uid] != podGone && p.DeletionTimestamp == nil {
			pods = append(pods, p)
		}
	}
	return pods
}

func (d *driver) seen(obj any, deleted bool) {
	pod, ok := obj.(*v1.Pod)
	if !ok {
		return
	}
	d.mu.Lock()
	if _, known := d.pods[pod.UID]; known || !deleted {
		d.pods[pod.UID] = pod
		if deleted {
			d.state[pod.UID] = podGone
		}
	}
	d.mu.Unlock()
	d.kick()
}

func (d *driver) kick() {
	select {
	case d.wakeup <- struct{}{}:
	default:
	}
}

// loop works on every known pod whenever something changed, and retries failures every second.
func (d *driver) loop(ctx context.Context) {
	for {
		d.mu.Lock()
		var work []*v1.Pod
		for uid, p := range d.pods {
			if !d.busy.Has(uid) {
				work = append(work, p)
				d.busy.Insert(uid)
			}
		}
		d.mu.Unlock()
		for _, p := range work {
			go d.sync(ctx, p)
		}
		select {
		case <-ctx.Done():
			return
		case <-d.wakeup:
		case <-time.After(d.retry):
		}
	}
}

func (d *driver) sync(ctx context.Context, pod *v1.Pod) {
	defer func() {
		d.mu.Lock()
		d.busy.Delete(pod.UID)
		d.mu.Unlock()
	}()
	d.mu.Lock()
	st := d.state[pod.UID]
	d.mu.Unlock()
	name := pod.Namespace + "/" + pod.Name
	switch {
	case st == podGone || pod.DeletionTimestamp != nil:
		if err := d.dra.UnprepareResources(ctx, pod); err != nil {
			emit(map[string]any{"event": "unprepare_failed", "pod": name, "uid": pod.UID, "error": err.Error()})
			return
		}
		if st != podGone {
			err := d.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
				GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: &pod.UID},
			})
			if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
				emit(map[string]any{"event": "delete_failed", "pod": name, "error": err.Error()})
				return
			}
		}
		d.mu.Lock()
		delete(d.pods, pod.UID)
		delete(d.state, pod.UID)
		d.mu.Unlock()
		emit(map[string]any{"event": "unprepared", "pod": name, "uid": pod.UID})
	case st == podPending:
		started := time.Now()
		if err := d.dra.PrepareResources(ctx, pod); err != nil {
			emit(map[string]any{"event": "prepare_failed", "pod": name, "uid": pod.UID, "error": err.Error()})
			return
		}
		cdi := map[string][]string{}
		for i := range pod.Spec.Containers {
			c := &pod.Spec.Containers[i]
			info, err := d.dra.GetResources(pod, c)
			if err != nil {
				emit(map[string]any{"event": "prepare_failed", "pod": name, "uid": pod.UID, "error": err.Error()})
				return
			}
			for _, dev := range info.CDIDevices {
				cdi[c.Name] = append(cdi[c.Name], dev.Name)
			}
		}
		if err := d.markRunning(ctx, pod); err != nil {
			emit(map[string]any{"event": "status_failed", "pod": name, "error": err.Error()})
			return
		}
		d.mu.Lock()
		if d.state[pod.UID] == podPending {
			d.state[pod.UID] = podRunning
		}
		d.mu.Unlock()
		emit(map[string]any{"event": "prepared", "pod": name, "uid": pod.UID, "cdi": cdi, "prepare_ms": float64(time.Since(started).Microseconds()) / 1000})
	}
}

func (d *driver) markRunning(ctx context.Context, pod *v1.Pod) error {
	p, err := d.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	now := metav1.Now()
	p.Status.Phase = v1.PodRunning
	p.Status.StartTime = &now
	p.Status.Conditions = []v1.PodCondition{{Type: v1.PodReady, Status: v1.ConditionTrue, LastTransitionTime: now}}
	p.Status.ContainerStatuses = nil
	for _, c := range p.Spec.Containers {
		p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, v1.ContainerStatus{
			Name: c.Name, Image: c.Image, Ready: true, Started: ptr.To(true),
			State: v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: now}},
		})
	}
	_, err = d.client.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
	return err
}

// healthUpdates reports the devices' health as the kubelet folds it into pod status
// (allocatedResourcesStatus) whenever the plugin's health stream changes something.
func (d *driver) healthUpdates(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case u := <-d.dra.Updates():
			d.mu.Lock()
			var pods []*v1.Pod
			for _, uid := range u.PodUIDs {
				if p, ok := d.pods[types.UID(uid)]; ok {
					pods = append(pods, p)
				}
			}
			d.mu.Unlock()
			for _, p := range pods {
				st := &v1.PodStatus{}
				for _, c := range p.Spec.Containers {
					st.ContainerStatuses = append(st.ContainerStatuses, v1.ContainerStatus{Name: c.Name})
				}
				d.dra.UpdateAllocatedResourcesStatus(klog.FromContext(ctx), p, st)
				var res []v1.ResourceStatus
				for _, cs := range st.ContainerStatuses {
					res = append(res, cs.AllocatedResourcesStatus...)
				}
				emit(map[string]any{"event": "health", "pod": p.Namespace + "/" + p.Name, "status": res})
			}
		}
	}
}
