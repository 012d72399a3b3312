//! What an operator graphs and alerts on (`agent/packaging/gpuvisor-alerts.yml`,
//! `gpuvisor-dashboard.json`): per-GPU capacity and the build, `promtool check` on the
//! shipped rules, and a real Prometheus server (Debian `prometheus`) scraping the agent's
//! loopback listener and loading the rules.

use gpuvisor_e2e::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::time::Duration;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `GET path` on 127.0.0.1:`port`: the body (empty when the server does not answer yet).
fn http_get(port: u16, path: &str) -> String {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return String::new() };
    // HTTP/1.0: the answer is never chunked.
    let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default()
}

fn rules_file() -> std::path::PathBuf {
    repo_root().join("agent/packaging/gpuvisor-alerts.yml")
}

/// Each managed GPU's placeable count per profile and its claimed framebuffer follow a
/// claim; `gpuvisor_build_info` names the version; the exposition stays promtool-clean.
#[test]
fn per_gpu_capacity_and_the_build_are_exported() {
    let a = Agent::start("l40s-2x16").unwrap();
    let before = a.metrics();
    let gpus: Vec<String> = a.ok("gpu.list", json!({}))["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["address"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(gpus.len(), 2, "{gpus:?}");
    for g in &gpus {
        assert_eq!(metric(&before, "gpuvisor_gpu_placeable", &[("gpu", g), ("profile", "L40S-2Q")]), Some(16.0));
        assert_eq!(metric(&before, "gpuvisor_gpu_claimed_framebuffer_mib", &[("gpu", g)]), Some(0.0));
    }
    let v = a.create_gpu("cap", "L40S-2Q").unwrap();
    let gpu = a.claims()[0]["gpu"].as_str().unwrap().to_string();
    let after = a.metrics();
    assert_eq!(metric(&after, "gpuvisor_gpu_claimed_framebuffer_mib", &[("gpu", &gpu)]), Some(2048.0), "{after}");
    assert_eq!(metric(&after, "gpuvisor_gpu_placeable", &[("gpu", &gpu), ("profile", "L40S-2Q")]), Some(15.0));
    assert_eq!(
        metric(&after, "gpuvisor_gpu_placeable", &[("gpu", &gpu), ("profile", "L40S-48Q")]),
        Some(0.0),
        "the equal-size rule: a 2Q on the GPU leaves no room for a 48Q"
    );
    assert_eq!(metric(&after, "gpuvisor_build_info", &[("version", env!("CARGO_PKG_VERSION"))]), Some(1.0));
    let mut check = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian prometheus, scripts/setup)");
    check.stdin.take().unwrap().write_all(after.as_bytes()).unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    a.ok("instance.delete", json!({"ref": v["id"]}));
}

/// The shipped rules pass `promtool check rules`; a Prometheus server scrapes the agent's
/// loopback listener, sees its series and loads every rule, each evaluating healthy.
#[test]
fn a_prometheus_server_scrapes_the_agent_and_loads_the_shipped_rules() {
    let out = std::process::Command::new("promtool").arg("check").arg("rules").arg(rules_file()).output().unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("SUCCESS: 5 rules found"));
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("agent/packaging/gpuvisor-dashboard.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    assert!(dash["panels"].as_array().is_some_and(|p| p.len() >= 6), "{dash}");

    let port = free_port();
    let extra = format!("metrics_listen = \"127.0.0.1:{port}\"\n");
    let a = Agent::start_with(AgentOptions { extra: &extra, ..Default::default() }).unwrap();
    a.create_gpu("p", "L40S-1Q").unwrap();
    let dir = a.dir.path().join("prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {rules:?}\n\
             scrape_configs:\n  - job_name: gpuvisor\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n",
            rules = rules_file()
        ),
    )
    .unwrap();
    let web = free_port();
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let server = std::process::Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{web}"))
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("prometheus (Debian prometheus, scripts/setup)");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _server = Kill(server);
    let query = |q: &str| -> Option<Vec<Value>> {
        let body = http_get(web, &format!("/api/v1/query?query={}", q));
        let v: Value = serde_json::from_str(&body).ok()?;
        v["data"]["result"].as_array().cloned().filter(|r| !r.is_empty())
    };
    let up = wait_for(Duration::from_secs(120), || query("up%7Bjob%3D%22gpuvisor%22%7D")).unwrap_or_else(|| {
        panic!(
            "Prometheus never scraped the agent: {}",
            std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
        )
    });
    assert_eq!(up[0]["value"][1], "1", "{up:?}");
    let running = wait_for(Duration::from_secs(60), || query("gpuvisor_instances%7Bstate%3D%22running%22%7D"))
        .expect("the agent's series reached Prometheus");
    assert_eq!(running[0]["value"][1], "1", "{running:?}");
    assert!(query("gpuvisor_build_info").is_some());
    let rules = wait_for(Duration::from_secs(60), || {
        let v: Value = serde_json::from_str(&http_get(web, "/api/v1/rules")).ok()?;
        let rules: Vec<Value> = v["data"]["groups"]
            .as_array()?
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        (rules.len() == 5 && rules.iter().all(|r| r["health"] == "ok")).then_some(rules)
    })
    .expect("Prometheus loaded the 5 rules, every one evaluated healthy");
    let names: Vec<&str> = rules.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert!(names.contains(&"GpuvisorReleasePending") && names.contains(&"GpuvisorRestartLoop"), "{names:?}");
}
