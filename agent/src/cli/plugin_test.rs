//! `gpuvisor plugin test`: runs a plugin locally on one input or a directory of recorded
//! inputs, optionally against a second plugin (docs/plugins.md "Testing a plugin offline").
//!
//! Exit codes: 0 when every input was run and every call answered; 1 when a plugin does
//! not load, an input cannot be read or is not an input of the kind, or a call fails (the
//! plugin's own `{"error": ..}` included); with `--fail-on-diff`, 1 also when an answer
//! differs (from the other plugin's with `--against`, else from the recorded one);
//! 2 for bad usage (unknown `--kind`, unreadable `--params`/`--config`).

use super::print::table;
use super::{exit, Output};
use crate::config::Config;
use gpuvisor_policy::{CallError, CallReport, InputFile, Limits, Plugin};
use gpuvisor_sdk::PolicyKind;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// The `plugin test` arguments.
pub struct TestArgs<'a> {
    pub plugin: &'a Path,
    pub input: &'a Path,
    pub kind: Option<&'a str>,
    pub params: Option<&'a Path>,
    pub config: Option<&'a Path>,
    pub against: Option<&'a Path>,
    pub fail_on_diff: bool,
}

/// One plugin's run on one input.
struct Run {
    result: Result<Value, CallError>,
    report: CallReport,
}

impl Run {
    fn reply(&self) -> Value {
        gpuvisor_policy::reply_json(&self.result)
    }

    /// The reply as compared with another plugin's or the recorded one
    /// ([`gpuvisor_policy::comparable_reply`]: the same error is the same, whichever plugin).
    fn key(&self) -> Value {
        gpuvisor_policy::comparable_reply(&self.reply())
    }

    fn same_as(&self, reply: &Value) -> bool {
        self.key() == gpuvisor_policy::comparable_reply(reply)
    }
}

/// A load error with its causes, as `plugin reload` gives it.
fn load_error(e: gpuvisor_policy::LoadError) -> String {
    format!("{:#}", anyhow::Error::new(e))
}

pub fn run(output: Output, a: &TestArgs<'_>) -> i32 {
    let kind = match a.kind {
        None => None,
        Some("placement") => Some(PolicyKind::Placement),
        Some("hypervisor") => Some(PolicyKind::Hypervisor),
        Some("grace") => Some(PolicyKind::Grace),
        Some(k) => {
            eprintln!("error: unknown kind {k:?} (placement, hypervisor, grace)");
            return exit::USAGE;
        }
    };
    let cfg = match a.config.map(Config::load).transpose() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: --config: {e:#}");
            return exit::USAGE;
        }
    };
    // Compiled plugins are kept in the user's cache directory, as the agent keeps them
    // under its data directory: a rerun on the same file does not compile again.
    gpuvisor_policy::set_cache_dir(user_cache_dir());
    let load = |path: &Path, kind: Option<PolicyKind>| -> Result<Plugin, String> {
        // The slot decides the config's limits: learn it first when not given.
        let kind = match kind {
            Some(k) => k,
            None => Plugin::load_any(path, Limits::default()).map_err(load_error)?.slot(),
        };
        let limits = cfg.as_ref().map(|c| crate::policies::limits_for(c, kind)).unwrap_or_default();
        Plugin::load(path, kind, limits).map_err(load_error)
    };
    let plugin = match load(a.plugin, kind) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::ERROR;
        }
    };
    let slot = plugin.slot();
    let other = match a.against.map(|p| load(p, Some(slot))).transpose() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: --against: {e}");
            return exit::ERROR;
        }
    };
    // Site params: --params, else the --config's slot params, else the recorded ones.
    let params = match (a.params, &cfg) {
        (Some(p), _) => match read_params(p, slot) {
            Ok(v) => Some((v, p.display().to_string())),
            Err(e) => {
                eprintln!("error: --params {}: {e}", p.display());
                return exit::USAGE;
            }
        },
        (None, Some(c)) if c.slot(slot).0.and_then(|s| s.params.as_ref()).is_some() => Some((
            c.plugin_params(slot),
            format!("[plugins.{}.params] of {}", slot.as_str(), a.config.unwrap_or(Path::new("")).display()),
        )),
        _ => None,
    };
    let files = match input_files(a.input, slot) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: --input {}: {e}", a.input.display());
            return exit::ERROR;
        }
    };
    let dir_mode = a.input.is_dir();
    let mut rows = Vec::new();
    for path in &files {
        let mut file = match gpuvisor_policy::read_input_file(path) {
            Ok(f) => f,
            Err(e) => {
                rows.push(Row { path: path.clone(), outcome: Err(e.to_string()) });
                continue;
            }
        };
        if dir_mode && file.kind.is_some_and(|k| k != slot) {
            continue; // a recording of another kind
        }
        if let (Some((p, _)), Some(obj)) = (&params, file.input.as_object_mut()) {
            obj.insert("params".into(), p.clone());
        }
        let run_one = |p: &Plugin, file: &InputFile| {
            gpuvisor_policy::run_input(p, &file.input)
                .map(|(result, report)| Run { result, report })
                .map_err(|e| format!("input file {}: {e}", path.display()))
        };
        let outcome = run_one(&plugin, &file).and_then(|a| {
            let b = other.as_ref().map(|o| run_one(o, &file)).transpose()?;
            Ok((a, b))
        });
        rows.push(Row { path: path.clone(), outcome: outcome.map(|(a, b)| (file.answer.take(), a, b)) });
    }
    let names = (plugin.manifest().name.clone(), other.as_ref().map(|o| o.manifest().name.clone()));
    let params_note = params.as_ref().map(|(v, from)| (v.clone(), from.clone()));
    let summary = Summary::of(&rows, other.is_some());
    if output == Output::Json {
        print_json(&plugin, other.as_ref(), params_note.as_ref(), &rows, &summary, dir_mode);
    } else if dir_mode || other.is_some() {
        print_rows(&names, params_note.as_ref(), &rows, &summary);
    } else {
        print_single(&plugin, params_note.as_ref(), &rows);
    }
    let differs = if other.is_some() { summary.differ_ab } else { summary.differ_recorded };
    if summary.failed > 0 || (a.fail_on_diff && differs > 0) {
        exit::ERROR
    } else {
        exit::OK
    }
}

/// One input's outcome: the recorded reply, plugin A's run, plugin B's (`--against`); or
/// why the input could not be run.
struct Row {
    path: PathBuf,
    outcome: Result<(Option<Value>, Run, Option<Run>), String>,
}

#[derive(Default)]
struct Summary {
    inputs: usize,
    /// Inputs not run, and calls that failed.
    failed: usize,
    differ_recorded: usize,
    recorded: usize,
    differ_ab: usize,
}

impl Summary {
    fn of(rows: &[Row], against: bool) -> Summary {
        let mut s = Summary { inputs: rows.len(), ..Default::default() };
        for r in rows {
            match &r.outcome {
                Err(_) => s.failed += 1,
                Ok((rec, a, b)) => {
                    s.failed +=
                        usize::from(a.result.is_err()) + usize::from(b.as_ref().is_some_and(|b| b.result.is_err()));
                    if let Some(rec) = rec {
                        s.recorded += 1;
                        s.differ_recorded += usize::from(!a.same_as(rec));
                    }
                    if against {
                        s.differ_ab += usize::from(b.as_ref().is_some_and(|b| b.key() != a.key()));
                    }
                }
            }
        }
        s
    }

    fn line(&self, against: bool) -> String {
        let mut s = format!("{} inputs, {} failed", self.inputs, self.failed);
        if against {
            s.push_str(&format!(", {} differ", self.differ_ab));
        }
        if self.recorded > 0 {
            s.push_str(&format!(", {} of {} recorded answers differ", self.differ_recorded, self.recorded));
        }
        s
    }
}

/// The files of `--input`: the file itself, or a directory's `*.json` files of the plugin's
/// kind (a recording's `kind`, or the `<kind>-` prefix `record_policy_inputs` and the
/// fixtures use; files of no known kind are kept), sorted by name.
fn input_files(input: &Path, kind: PolicyKind) -> Result<Vec<PathBuf>, String> {
    if !input.is_dir() {
        return Ok(vec![input.to_path_buf()]);
    }
    let kinds = ["placement", "hypervisor", "grace"];
    let mut files: Vec<PathBuf> = std::fs::read_dir(input)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            match kinds.iter().find(|k| name.starts_with(&format!("{k}-"))) {
                Some(k) => *k == kind.as_str(),
                None => true,
            }
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("no {} inputs (*.json) in the directory", kind.as_str()));
    }
    Ok(files)
}

/// `--params FILE`: JSON or TOML; the params table itself, or an agent config file (a
/// `plugins` table), whose `[plugins.<kind>.params]` is taken.
fn read_params(path: &Path, kind: PolicyKind) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let v: Value = if text.trim_start().starts_with('{') {
        serde_json::from_str(&text).map_err(|e| format!("not JSON: {e}"))?
    } else {
        let t: toml::Table = toml::from_str(&text).map_err(|e| format!("not TOML: {e}"))?;
        serde_json::to_value(t).map_err(|e| e.to_string())?
    };
    let Some(obj) = v.as_object() else { return Err("not a table".into()) };
    match obj.get("plugins") {
        Some(plugins) => Ok(plugins
            .get(kind.as_str())
            .and_then(|s| s.get("params"))
            .cloned()
            .ok_or_else(|| format!("an agent config without [plugins.{}.params]", kind.as_str()))?),
        None => Ok(v),
    }
}

fn compact(v: &Value, max: usize) -> String {
    let s = serde_json::to_string(v).unwrap_or_default();
    if s.chars().count() > max {
        format!("{}…", s.chars().take(max).collect::<String>())
    } else {
        s
    }
}

/// A reply in a few words: the `ok` answer compacted, or `error <reason>: <message>`.
fn summary_of(run: &Run, max: usize) -> String {
    match &run.result {
        Ok(v) => match v.get("ranked").and_then(|r| r.as_array()) {
            // A placement answer: how many, and the first few devices.
            Some(r) => {
                let first: Vec<String> = r.iter().take(3).map(|d| d.as_str().unwrap_or("?").to_string()).collect();
                let more = if r.len() > 3 { ", …" } else { "" };
                format!("ranked {}: {}{more}", r.len(), first.join(", "))
            }
            None => compact(v, max),
        },
        Err(e) => {
            let detail = gpuvisor_policy::comparable_reply(&run.reply());
            let message = detail.pointer("/error/message").and_then(Value::as_str).unwrap_or_default();
            cut(&format!("error {}: {message}", e.reason()), max)
        }
    }
}

/// `s` cut to `max` characters (an ellipsis marks the cut).
fn cut(s: &str, max: usize) -> String {
    if s.chars().count() > max {
        format!("{}…", s.chars().take(max).collect::<String>())
    } else {
        s.to_string()
    }
}

/// Where two different replies first differ, in a few words: the first rank two ranked
/// lists disagree on, or both replies from their first differing character.
fn difference(a: &Run, b: &Run, max: usize) -> String {
    let (ka, kb) = (a.key(), b.key());
    let ranked = |k: &Value| k.pointer("/ok/ranked").and_then(Value::as_array).cloned();
    if let (Some(ra), Some(rb)) = (ranked(&ka), ranked(&kb)) {
        let text = |r: &[Value], i: usize| r.get(i).map(|d| compact(d, 40)).unwrap_or_else(|| "nothing".into());
        match (0..ra.len().max(rb.len())).find(|&i| ra.get(i) != rb.get(i)) {
            Some(i) => return format!("first difference at rank {}: A {}, B {}", i + 1, text(&ra, i), text(&rb, i)),
            None => return "the same ranks".into(),
        }
    }
    let (sa, sb) = (compact(&ka, usize::MAX), compact(&kb, usize::MAX));
    let at = sa.chars().zip(sb.chars()).take_while(|(x, y)| x == y).count().saturating_sub(10);
    let from = |s: &str| {
        let tail: String = s.chars().skip(at).collect();
        format!("{}{}", if at > 0 { "…" } else { "" }, cut(&tail, max))
    };
    format!("first difference: A {}, B {}", from(&sa), from(&sb))
}

/// The fuel a call used, or why it is not known (`long`: the whole reason).
fn fuel(run: &Run, long: bool) -> String {
    match (run.report.fuel_used, long) {
        (Some(f), _) => f.to_string(),
        (None, true) => "not counted: the call was stopped inside a function (by its deadline or a trap), and \
                         wasmtime counts a function's fuel only at its calls and returns"
            .into(),
        (None, false) => "-".into(),
    }
}

fn ms(run: &Run) -> String {
    format!("{:.2} ms", run.report.wall.as_secs_f64() * 1000.0)
}

fn recorded_note(rec: &Option<Value>, a: &Run) -> String {
    match rec {
        None => "-".into(),
        Some(r) if a.same_as(r) => "same".into(),
        Some(r) => format!("differs (recorded {})", compact(r, 60)),
    }
}

fn print_single(plugin: &Plugin, params: Option<&(Value, String)>, rows: &[Row]) {
    let Some(row) = rows.first() else { return };
    let l = plugin.limits();
    println!(
        "plugin:  {} {} ({}, ABI v{})",
        plugin.manifest().name,
        plugin.manifest().version,
        plugin.slot().as_str(),
        plugin.abi_version()
    );
    println!("input:   {}", row.path.display());
    println!("limits:  fuel {}, memory {} MiB, deadline {} ms", l.fuel, l.memory_bytes >> 20, l.deadline.as_millis());
    if let Some((v, from)) = params {
        println!("params:  {} (from {}; replaces the input's params)", compact(v, 200), from);
    }
    let (rec, a) = match &row.outcome {
        Err(e) => {
            eprintln!("error: {e}");
            return;
        }
        Ok((rec, a, _)) => (rec, a),
    };
    if a.report.logs.is_empty() {
        println!("log:     (none)");
    }
    for (i, line) in a.report.logs.iter().enumerate() {
        println!("{}{:<5}  {}", if i == 0 { "log:     " } else { "         " }, line.level, line.line);
    }
    if a.report.logs_dropped > 0 {
        println!("         ({} lines dropped by the rate limit)", a.report.logs_dropped);
    }
    if a.report.output_bytes_dropped > 0 {
        println!(
            "         ({} bytes of stdout/stderr dropped past the {} KiB capture)",
            a.report.output_bytes_dropped,
            gpuvisor_policy::STDIO_CAPTURE_BYTES >> 10
        );
    }
    println!("fuel:    {}", fuel(a, true));
    println!("time:    {}", ms(a));
    match &a.result {
        Ok(v) => {
            println!("answer:  {}", serde_json::to_string_pretty(v).unwrap_or_default().replace('\n', "\n         "))
        }
        Err(e) => println!("error:   {e}"),
    }
    if rec.is_some() {
        println!("recorded: {}", recorded_note(rec, a));
    }
}

fn print_rows(names: &(String, Option<String>), params: Option<&(Value, String)>, rows: &[Row], summary: &Summary) {
    if let Some((v, from)) = params {
        println!("params {} (from {}; replace every input's params)", compact(v, 200), from);
    }
    let file = |r: &Row| r.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    match &names.1 {
        None => {
            let table_rows = rows
                .iter()
                .map(|r| match &r.outcome {
                    Err(e) => vec![file(r), format!("error: {e}"), "-".into(), "-".into(), "-".into()],
                    Ok((rec, a, _)) => {
                        vec![file(r), summary_of(a, 60), fuel(a, false), ms(a), recorded_note(rec, a)]
                    }
                })
                .collect();
            table(&["INPUT", "ANSWER", "FUEL", "TIME", "RECORDED"], table_rows);
            // The table cuts an error short: each failed call's whole message.
            for r in rows {
                if let Ok((_, Run { result: Err(e), .. }, _)) = &r.outcome {
                    println!("{}: {e}", file(r));
                }
            }
        }
        Some(b_name) => {
            let a_name = &names.0;
            for r in rows {
                match &r.outcome {
                    Err(e) => println!("{}  error: {e}", file(r)),
                    Ok((_, a, Some(b))) if a.key() == b.key() => {
                        println!("{}  same: {}", file(r), summary_of(a, 80))
                    }
                    Ok((_, a, b)) => {
                        println!("{}  differs", file(r));
                        println!("  A {a_name}: {}", summary_of(a, 100));
                        if let Some(b) = b {
                            println!("  B {b_name}: {}", summary_of(b, 100));
                            // The summaries may agree where the answers do not.
                            println!("  {}", difference(a, b, 60));
                        }
                    }
                }
            }
        }
    }
    println!("summary: {}", summary.line(names.1.is_some()));
}

fn print_json(
    plugin: &Plugin,
    other: Option<&Plugin>,
    params: Option<&(Value, String)>,
    rows: &[Row],
    summary: &Summary,
    dir_mode: bool,
) {
    let run_json = |p: &Plugin, r: &Run| {
        json!({
            "plugin": p.manifest().name,
            "logs": r.report.logs,
            "logs_dropped": r.report.logs_dropped,
            "output_bytes_dropped": r.report.output_bytes_dropped,
            "fuel_used": r.report.fuel_used,
            "wall_ms": r.report.wall.as_secs_f64() * 1000.0,
            "waited_ms": r.report.waited.as_secs_f64() * 1000.0,
            "reply": r.reply(),
            "answer": r.result.as_ref().ok(),
        })
    };
    let inputs: Vec<Value> = rows
        .iter()
        .map(|r| match &r.outcome {
            Err(e) => json!({ "input": r.path, "error": e }),
            Ok((rec, a, b)) => {
                let mut v = run_json(plugin, a);
                v["input"] = json!(r.path);
                v["recorded_reply"] = json!(rec);
                v["same_as_recorded"] = json!(rec.as_ref().map(|rec| a.same_as(rec)));
                if let (Some(o), Some(b)) = (other, b) {
                    v["against"] = run_json(o, b);
                    v["same_as_against"] = json!(b.key() == a.key());
                }
                v
            }
        })
        .collect();
    let l = plugin.limits();
    let head = json!({
        "plugin": plugin.manifest().name,
        "kind": plugin.slot().as_str(),
        "abi": plugin.abi_version(),
        "limits": { "fuel": l.fuel, "memory_bytes": l.memory_bytes, "deadline_ms": l.deadline.as_millis() as u64 },
        "params": params.map(|(v, from)| json!({ "value": v, "from": from })),
    });
    let out = if dir_mode || other.is_some() {
        let mut h = head;
        h["against"] = json!(other.map(|o| o.manifest().name.clone()));
        h["inputs"] = json!(inputs);
        h["summary"] = json!({
            "inputs": summary.inputs,
            "failed": summary.failed,
            "differ": summary.differ_ab,
            "recorded": summary.recorded,
            "differ_from_recorded": summary.differ_recorded,
        });
        h
    } else {
        let mut v = inputs.into_iter().next().unwrap_or(Value::Null);
        if let (Some(obj), Some(h)) = (v.as_object_mut(), head.as_object()) {
            for (k, x) in h {
                obj.entry(k.clone()).or_insert_with(|| x.clone());
            }
            obj.insert("limits".into(), head["limits"].clone());
            obj.insert("params".into(), head["params"].clone());
            obj.insert("kind".into(), head["kind"].clone());
        }
        v
    };
    println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
}

/// `$XDG_CACHE_HOME/gpuvisor/plugin-cache`, else `$HOME/.cache/gpuvisor/plugin-cache`.
fn user_cache_dir() -> Option<std::path::PathBuf> {
    let base =
        std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()).map(std::path::PathBuf::from).or_else(|| {
            std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|h| std::path::PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("gpuvisor/plugin-cache"))
}
