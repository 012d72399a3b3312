//! # Kubernetes harness
//!
//! A real control plane (etcd 3.5, kube-apiserver, kube-scheduler and kube-controller-manager
//! v1.37.2, from the cache `scripts/kube-build` fills; started by `scripts/kube-up` on loopback
//! ports of its own), and a node: `gpuvisor-dra` against an [`Agent`](crate::Agent)'s socket,
//! plus `kubelet-driver` (tests/kube: the kubelet's own DRA manager and plugin manager) keeping
//! the Node object Ready and preparing/unpreparing its pods' claims. A missing binary is a
//! failure that names `scripts/kube-build`, never a skip.
//!
//! The API server is reached with `kube`'s client through plain paths and JSON (the tests
//! read the objects as the API server answers them).

use crate::{repo_root, tail, wait_for};
use serde_json::{json, Value};
use std::io::BufRead;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The driver name.
pub const DRIVER: &str = "gpu.gpuvisor.example";

/// A blocking client of the API server.
pub struct Kube {
    rt: tokio::runtime::Runtime,
    client: kube::Client,
}

/// An API answer that is not success: the HTTP status and the Status object.
#[derive(Debug)]
pub struct ApiError {
    /// The HTTP status (`0` when the request did not reach the API server).
    pub code: u16,
    /// The Status object's message and reason, or the client's error.
    pub body: String,
}

impl Kube {
    /// A client of the cluster in `kubeconfig`, on a runtime of its own.
    pub fn new(kubeconfig: &Path) -> Kube {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let client = rt.block_on(async {
            let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
            let cfg = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .expect("config");
            kube::Client::try_from(cfg).expect("client")
        });
        Kube { rt, client }
    }

    /// One request; the body is JSON (`null` for none).
    pub fn request(&self, method: &str, path: &str, body: Value, content_type: &str) -> Result<Value, ApiError> {
        let body = if body.is_null() { Vec::new() } else { serde_json::to_vec(&body).expect("json") };
        let req = http::Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", content_type)
            .body(body)
            .expect("request");
        self.rt.block_on(async {
            match self.client.request_text(req).await {
                Ok(text) => Ok(serde_json::from_str(&text).unwrap_or(Value::String(text))),
                Err(kube::Error::Api(e)) => {
                    Err(ApiError { code: e.code, body: format!("{} ({})", e.message, e.reason) })
                }
                Err(e) => Err(ApiError { code: 0, body: e.to_string() }),
            }
        })
    }

    /// GETs `path`: `None` on 404; panics on any other error.
    pub fn get(&self, path: &str) -> Option<Value> {
        match self.request("GET", path, Value::Null, "application/json") {
            Ok(v) => Some(v),
            Err(e) if e.code == 404 => None,
            Err(e) => panic!("GET {path}: {e:?}"),
        }
    }

    /// POSTs `obj` to `path` and returns the created object; panics on an error.
    pub fn create(&self, path: &str, obj: Value) -> Value {
        self.request("POST", path, obj.clone(), "application/json")
            .unwrap_or_else(|e| panic!("POST {path} {obj}: {e:?}"))
    }

    /// DELETEs `path`, with `gracePeriodSeconds` = `grace` when given.
    pub fn delete(&self, path: &str, grace: Option<i64>) -> Result<Value, ApiError> {
        let body = match grace {
            Some(g) => json!({ "kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": g }),
            None => Value::Null,
        };
        self.request("DELETE", path, body, "application/json")
    }

    /// The `items` of the list at `path` (empty when it is not found).
    pub fn list(&self, path: &str) -> Vec<Value> {
        self.get(path).and_then(|v| v["items"].as_array().cloned()).unwrap_or_default()
    }

    /// Applies a JSON merge patch to `path`; panics on an error.
    pub fn merge_patch(&self, path: &str, patch: Value) -> Value {
        self.request("PATCH", path, patch, "application/merge-patch+json")
            .unwrap_or_else(|e| panic!("PATCH {path}: {e:?}"))
    }
}

/// A quantity as the API server writes it back (`48Gi`, `40960Mi`, `16`), in units.
pub fn quantity(q: &str) -> u64 {
    let (num, mult) = match q {
        _ if q.ends_with("Ki") => (&q[..q.len() - 2], 1u64 << 10),
        _ if q.ends_with("Mi") => (&q[..q.len() - 2], 1 << 20),
        _ if q.ends_with("Gi") => (&q[..q.len() - 2], 1 << 30),
        _ if q.ends_with("Ti") => (&q[..q.len() - 2], 1 << 40),
        _ => (q, 1),
    };
    num.parse::<u64>().unwrap_or_else(|_| panic!("quantity {q:?}")) * mult
}

/// A control plane on loopback.
pub struct Cluster {
    /// The control plane's files (certificates, etcd data, logs).
    pub dir: tempfile::TempDir,
    child: Child,
    /// The admin kubeconfig of the cluster.
    pub kubeconfig: PathBuf,
    /// A client of the cluster.
    pub k: Kube,
}

fn require(path: &Path) {
    assert!(
        path.exists(),
        "{} is missing: run scripts/kube-build (scripts/test runs it before the Kubernetes tests)",
        path.display()
    );
}

/// `target/kube/`: the links scripts/kube-build makes to its cache, and the kubelet driver.
pub fn kube_dir() -> PathBuf {
    repo_root().join("target/kube")
}

impl Cluster {
    /// Starts etcd, the API server, the controller manager and the scheduler; returns once all
    /// answer their health checks.
    pub fn start() -> Cluster {
        for b in ["bin/kube-apiserver", "bin/kube-scheduler", "bin/kube-controller-manager", "etcd", "kubelet-driver"] {
            require(&kube_dir().join(b));
        }
        let dir = tempfile::Builder::new().prefix("gpuvisor-kube.").tempdir().expect("tempdir");
        let log = std::fs::File::create(dir.path().join("kube-up.log")).expect("log");
        let mut child = Command::new(repo_root().join("scripts/kube-up"))
            .arg(dir.path().join("cp"))
            .args(["--parent", &std::process::id().to_string()])
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("scripts/kube-up");
        let out = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let ready = rx.recv_timeout(Duration::from_secs(300)).unwrap_or_default();
        if !ready.starts_with("kube-up: ready") {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = child.wait();
            panic!(
                "the control plane did not start: {ready:?}\n{}",
                std::fs::read_to_string(dir.path().join("kube-up.log")).unwrap_or_default()
            );
        }
        let kubeconfig = dir.path().join("cp/kubeconfig");
        let k = Kube::new(&kubeconfig);
        Cluster { dir, child, kubeconfig, k }
    }

    /// A component's log (`kube-scheduler`, `kube-apiserver`, …).
    pub fn log(&self, component: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("cp/{component}.log"))).unwrap_or_default()
    }

    /// The DeviceClasses of the README: vGPUs (by kind) and whole GPUs.
    pub fn device_classes(&self) {
        for (name, kind) in [("vgpu.gpuvisor.example", "vgpu"), ("gpu.gpuvisor.example", "passthrough")] {
            self.k.create(
                "/apis/resource.k8s.io/v1/deviceclasses",
                json!({ "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": { "name": name },
                        "spec": { "selectors": [{ "cel": { "expression":
                            format!("device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].kind == '{kind}'") } }] } }),
            );
        }
    }

    /// Creates a ResourceClaim for one device: a vGPU `profile` (e.g. `L40S-2Q`), or a whole
    /// GPU with `profile = None`.
    pub fn claim(&self, ns: &str, name: &str, profile: Option<&str>) -> Value {
        let exact = match profile {
            Some(p) => json!({ "deviceClassName": "vgpu.gpuvisor.example",
                               "selectors": [{ "cel": { "expression": format!("device.attributes['{DRIVER}'].profile == '{p}'") } }] }),
            None => json!({ "deviceClassName": "gpu.gpuvisor.example" }),
        };
        self.k.create(
            &format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"),
            json!({ "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": { "name": name },
                    "spec": { "devices": { "requests": [{ "name": "gpu", "exactly": exact }] } } }),
        )
    }

    /// Creates a pod on `node` (through the scheduler: a node selector) using claim `claim`.
    pub fn pod(&self, ns: &str, name: &str, node: &str, claim: &str) -> Value {
        self.k.create(
            &format!("/api/v1/namespaces/{ns}/pods"),
            json!({ "apiVersion": "v1", "kind": "Pod", "metadata": { "name": name },
                    "spec": { "nodeSelector": { "kubernetes.io/hostname": node }, "terminationGracePeriodSeconds": 30,
                              "resourceClaims": [{ "name": "gpu", "resourceClaimName": claim }],
                              "containers": [{ "name": "vm", "image": "gpuvisor.test/none", "resources": { "claims": [{ "name": "gpu" }] } }] } }),
        )
    }

    /// The ResourceClaim `ns/name`, `None` when it does not exist.
    pub fn get_claim(&self, ns: &str, name: &str) -> Option<Value> {
        self.k.get(&format!("/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}"))
    }

    /// The Pod `ns/name`, `None` when it does not exist.
    pub fn get_pod(&self, ns: &str, name: &str) -> Option<Value> {
        self.k.get(&format!("/api/v1/namespaces/{ns}/pods/{name}"))
    }

    /// Deletes the Pod `ns/name` (with `grace` seconds when given).
    pub fn delete_pod(&self, ns: &str, name: &str, grace: Option<i64>) {
        match self.k.delete(&format!("/api/v1/namespaces/{ns}/pods/{name}"), grace) {
            Ok(_) => {}
            Err(e) if e.code == 404 => {}
            Err(e) => panic!("delete pod {name}: {e:?}"),
        }
    }

    /// This driver's slices of `node`.
    pub fn slices(&self, node: &str) -> Vec<Value> {
        let mut s: Vec<Value> = self
            .k
            .list(&format!("/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{node}"))
            .into_iter()
            .filter(|s| s["spec"]["driver"] == DRIVER)
            .collect();
        s.sort_by_key(|s| s["metadata"]["name"].as_str().unwrap_or("").to_string());
        s
    }

    /// The slices of a node's pool at its newest generation once all of them are there (the
    /// publisher writes a generation slice by slice): waits up to 60 s for that, then panics.
    pub fn pool(&self, node: &str) -> Vec<Value> {
        let complete = || {
            let s = self.slices(node);
            let gen = s.iter().filter_map(|x| x["spec"]["pool"]["generation"].as_i64()).max()?;
            let at: Vec<Value> =
                s.into_iter().filter(|x| x["spec"]["pool"]["generation"].as_i64() == Some(gen)).collect();
            let want = at.first()?["spec"]["pool"]["resourceSliceCount"].as_u64()?;
            (at.len() as u64 == want).then_some(at)
        };
        crate::wait_for(std::time::Duration::from_secs(60), complete)
            .unwrap_or_else(|| panic!("{node}'s pool never became complete: {:?}", self.slices(node)))
    }

    /// The devices of a node's pool at its newest complete generation (by name).
    pub fn devices(&self, node: &str) -> std::collections::BTreeMap<String, Value> {
        self.pool(node)
            .iter()
            .flat_map(|x| x["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .map(|d| (d["name"].as_str().unwrap_or("").to_string(), d))
            .collect()
    }

    /// The counter sets of a node's pool at its newest complete generation: name →
    /// (framebuffer in MiB, vfs).
    pub fn counters(&self, node: &str) -> std::collections::BTreeMap<String, (u64, u64)> {
        self.pool(node)
            .iter()
            .flat_map(|x| x["spec"]["sharedCounters"].as_array().cloned().unwrap_or_default())
            .map(|c| {
                let f = |k: &str| quantity(c["counters"][k]["value"].as_str().unwrap_or(""));
                (c["name"].as_str().unwrap_or("").to_string(), (f("framebuffer") >> 20, f("vfs")))
            })
            .collect()
    }

    /// The allocated devices of a claim (this driver's results).
    pub fn allocated(&self, ns: &str, name: &str) -> Vec<String> {
        self.get_claim(ns, name)
            .and_then(|c| c["status"]["allocation"]["devices"]["results"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter(|r| r["driver"] == DRIVER)
            .filter_map(|r| r["device"].as_str().map(str::to_string))
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let pg = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::killpg(pg, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = nix::sys::signal::killpg(pg, nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
        if std::thread::panicking() {
            for c in ["kube-scheduler", "kube-controller-manager"] {
                eprintln!("--- {c} log (tail) ---\n{}", tail(&self.log(c), 30));
            }
        }
    }
}

/// The node side: `gpuvisor-dra` and the kubelet driver.
pub struct KubeNode {
    /// The node's name (also its pool's name).
    pub name: String,
    /// The node's kubelet, plugin and CDI directories and the logs.
    pub dir: tempfile::TempDir,
    kubeconfig: PathBuf,
    agent_socket: PathBuf,
    dra: Option<Child>,
    kubelet: Option<Child>,
    /// Every line the kubelet driver printed (JSON), across its restarts.
    pub events: Arc<Mutex<Vec<Value>>>,
    /// Extra arguments and environment of the next `gpuvisor-dra` start.
    pub dra_args: Vec<String>,
    /// Extra arguments of the next kubelet driver start (e.g. `--dra-services v1beta1.DRAPlugin`).
    pub kubelet_args: Vec<String>,
    /// Extra environment of the next `gpuvisor-dra` start.
    pub dra_env: Vec<(String, String)>,
}

/// The `gpuvisor-dra` binary built beside the tests.
pub fn dra_binary() -> PathBuf {
    let p = crate::agent_binary().with_file_name("gpuvisor-dra");
    assert!(p.is_file(), "{} not built (cargo build -p gpuvisor-dra)", p.display());
    p
}

impl KubeNode {
    /// A node named `name` for the agent at `agent_socket`; nothing runs yet.
    pub fn new(cluster: &Cluster, name: &str, agent_socket: &Path) -> KubeNode {
        KubeNode {
            name: name.into(),
            dir: tempfile::Builder::new().prefix("gpuvisor-kubenode.").tempdir().expect("tempdir"),
            kubeconfig: cluster.kubeconfig.clone(),
            agent_socket: agent_socket.to_path_buf(),
            dra: None,
            kubelet: None,
            events: Default::default(),
            dra_args: Vec::new(),
            kubelet_args: Vec::new(),
            dra_env: Vec::new(),
        }
    }

    /// The kubelet's plugin registration directory.
    pub fn registry_dir(&self) -> PathBuf {
        self.dir.path().join("kubelet/plugins_registry")
    }

    /// The DRA plugin's directory (its socket and device metadata).
    pub fn plugin_dir(&self) -> PathBuf {
        self.dir.path().join("kubelet/plugins").join(DRIVER)
    }

    /// The CDI spec directory `gpuvisor-dra` writes.
    pub fn cdi_dir(&self) -> PathBuf {
        self.dir.path().join("cdi")
    }

    /// What `gpuvisor-dra` logged so far (empty before its first start).
    pub fn dra_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("gpuvisor-dra.log")).unwrap_or_default()
    }

    /// What the kubelet driver logged so far.
    pub fn kubelet_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("kubelet-driver.log")).unwrap_or_default()
    }

    /// Starts `gpuvisor-dra serve`.
    pub fn start_dra(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("gpuvisor-dra.log"))
            .expect("log");
        let child = Command::new(dra_binary())
            .args(["serve", "--node", &self.name, "--resync-seconds", "2"])
            .arg("--agent-socket")
            .arg(&self.agent_socket)
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--plugin-dir")
            .arg(self.plugin_dir())
            .arg("--registry-dir")
            .arg(self.registry_dir())
            .arg("--cdi-dir")
            .arg(self.cdi_dir())
            .args(&self.dra_args)
            .env("GPUVISOR_LOG", "info,gpuvisor_dra=debug")
            .envs(self.dra_env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("gpuvisor-dra");
        self.dra = Some(child);
    }

    /// Stops `gpuvisor-dra` with `sig` and waits for it.
    pub fn stop_dra(&mut self, sig: nix::sys::signal::Signal) -> Option<std::process::ExitStatus> {
        let mut c = self.dra.take()?;
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.id() as i32), sig);
        c.wait().ok()
    }

    /// Waits for `gpuvisor-dra` to exit by itself (a crash point), up to `timeout`.
    pub fn wait_dra_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let c = self.dra.as_mut()?;
        let st = wait_for(timeout, || c.try_wait().ok().flatten())?;
        self.dra = None;
        Some(st)
    }

    /// Starts the kubelet driver (its state directory survives restarts, as a kubelet's does).
    pub fn start_kubelet(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("kubelet-driver.log"))
            .expect("log");
        let mut child = Command::new(kube_dir().join("kubelet-driver"))
            .args(["--node", &self.name])
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .arg("--root")
            .arg(self.dir.path().join("kubelet"))
            .args(&self.kubelet_args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("kubelet-driver");
        let out = child.stdout.take().expect("stdout");
        let events = self.events.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let v = serde_json::from_str(&line).unwrap_or(Value::String(line));
                events.lock().unwrap_or_else(|p| p.into_inner()).push(v);
            }
        });
        self.kubelet = Some(child);
        self.wait_event(Duration::from_secs(60), |e| e["event"] == "started").expect("kubelet driver started");
    }

    /// Kills the kubelet driver (SIGKILL, as a crashed kubelet).
    pub fn kill_kubelet(&mut self) {
        if let Some(mut c) = self.kubelet.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The kubelet driver's events so far.
    pub fn events(&self) -> Vec<Value> {
        self.events.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits for an event (from the start of the log) matching `f`.
    pub fn wait_event(&self, timeout: Duration, f: impl Fn(&Value) -> bool) -> Option<Value> {
        wait_for(timeout, || self.events().into_iter().find(|e| f(e)))
    }

    /// Waits for an event after the first `skip` ones.
    pub fn wait_event_after(&self, skip: usize, timeout: Duration, f: impl Fn(&Value) -> bool) -> Option<Value> {
        wait_for(timeout, || self.events().into_iter().skip(skip).find(|e| f(e)))
    }

    /// Waits until the kubelet registered the plugin.
    pub fn wait_registered(&self) -> Value {
        self.wait_event(Duration::from_secs(90), |e| e["event"] == "registered" && e["driver"] == DRIVER)
            .unwrap_or_else(|| {
                panic!("the plugin was never registered: {:?}\n{}", self.events(), tail(&self.dra_log(), 40))
            })
    }
}

impl Drop for KubeNode {
    fn drop(&mut self) {
        self.kill_kubelet();
        self.stop_dra(nix::sys::signal::Signal::SIGKILL);
        if std::thread::panicking() {
            eprintln!("--- gpuvisor-dra log (tail) ---\n{}", tail(&self.dra_log(), 60));
            eprintln!(
                "--- kubelet-driver events (tail) ---\n{}",
                tail(&self.events().iter().map(|e| e.to_string()).collect::<Vec<_>>().join("\n"), 30)
            );
        }
    }
}
