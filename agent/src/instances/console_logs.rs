//! The console logs' cap: every [`crate::console::ROTATE_EVERY`] the agent checks each
//! instance's `serial.log` (in its VMM directory) and rotates the QEMU ones larger than
//! `console_log_max_bytes` into its instance directory ([`crate::console::rotate`]). A
//! failure is logged once per instance until it succeeds again.

use super::Manager;
use crate::hypervisor::SERIAL_LOG;
use crate::sync::lock;

impl Manager {
    /// One check of every instance's console log (see the module docs).
    pub fn rotate_console_logs(&self) {
        let max = self.cfg.console_log_max_bytes;
        let Ok(entries) = std::fs::read_dir(self.store.root().join("instances")) else { return };
        for e in entries.flatten() {
            let vmm = e.path().join(crate::hypervisor::confine::VMM_DIR);
            // Cheap first: only a log over the cap costs a record read (a link is not followed
            // here; `rotate` refuses anything that is not the agent's own file).
            if std::fs::symlink_metadata(vmm.join(SERIAL_LOG)).map(|m| m.len() <= max).unwrap_or(true) {
                continue;
            }
            let id = e.file_name().to_string_lossy().into_owned();
            let Some(rec) = uuid::Uuid::parse_str(&id).ok().and_then(|u| self.store.read_instance(u).ok().flatten())
            else {
                continue;
            };
            // Only a VMM that appends (QEMU's logappend=on, O_APPEND): truncating another
            // writer's file would leave it writing past the new end.
            if !rec.hypervisor.driver().serial_log_appends() {
                continue;
            }
            let mut failing = lock(&self.console_rotation_failures);
            match crate::console::rotate(&vmm, &e.path(), max) {
                Ok(true) => {
                    failing.remove(&rec.id);
                    tracing::info!(instance.id = %rec.id, instance.name = %rec.name, max_bytes = max,
                        "console log rotated to serial.log.1")
                }
                Ok(false) => {}
                Err(err) => {
                    if failing.insert(rec.id) {
                        tracing::warn!(instance.id = %rec.id, instance.name = %rec.name, error = %err,
                            "the console log cannot be rotated");
                    }
                }
            }
        }
    }
}
