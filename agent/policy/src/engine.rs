//! The process-wide wasmtime engine every plugin is compiled for, and its epoch ticker.
//!
//! One engine (fuel and epoch interruption on, pooling instance allocator) is created on
//! first use. One ticker thread increments the engine's epoch every [`TICK`] while at
//! least one call is running, and parks otherwise, so an idle agent pays nothing.
//! At each tick a running call compares the wall clock with its deadline (the ticker's
//! pace does not matter: a late tick only makes the check late).
//!
//! The instance pool is divided into [`Share`]s: one per slot (`placement`, `hypervisor`,
//! `grace`) and one for load-time calls (manifests). Each share runs at most
//! [`SLOT_CALLS`] calls at once, and the pool holds, for every share, that many calls of a
//! component of the largest allowed shape; so no share can take what another needs. A call
//! that finds its share full waits for a free place, at most its deadline.

use gpuvisor_sdk::PolicyKind;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

/// The epoch tick: the resolution of call deadlines.
pub const TICK: Duration = Duration::from_millis(1);

/// The largest memory any plugin may be allowed (`Limits::memory_bytes` is capped to it):
/// the size of a pooled memory slot.
pub const MAX_MEMORY_BYTES: usize = 256 << 20;

/// Calls one [`Share`] (one slot, or the loads) runs at once.
pub const SLOT_CALLS: u32 = 8;

/// The shares of the pool: the three slots and the loads.
const SHARES: u32 = 4;

/// How many plugin instances may be alive at once (concurrent calls, all shares).
pub const POOL_INSTANCES: u32 = SLOT_CALLS * SHARES;

/// Core instances one component may have (a guest built by componentize-py or
/// componentize-js has a handful: the program, its WASI adapter, shims).
pub(crate) const MAX_CORE_INSTANCES_PER_COMPONENT: u32 = 32;
/// Linear memories one component may have.
pub(crate) const MAX_MEMORIES_PER_COMPONENT: u32 = 8;
/// Tables one component may have.
pub(crate) const MAX_TABLES_PER_COMPONENT: u32 = 32;
/// Elements of one table (an interpreter's function table is large).
pub(crate) const MAX_TABLE_ELEMENTS: usize = 100_000;

/// The engine and its ticker.
pub(crate) struct Shared {
    pub(crate) engine: Engine,
    active: AtomicUsize,
    ticker: OnceLock<Thread>,
}

static SHARED: OnceLock<Result<Shared, String>> = OnceLock::new();

/// The shared engine, created on first use. Errors: the engine could not be created
/// (the message says why); the error is sticky for the process.
pub(crate) fn shared() -> Result<&'static Shared, String> {
    match SHARED.get_or_init(create) {
        Ok(shared) => Ok(shared),
        Err(e) => Err(e.clone()),
    }
}

fn base_config() -> Config {
    let mut config = Config::new();
    config.consume_fuel(true);
    config.epoch_interruption(true);
    config
}

fn create() -> Result<Shared, String> {
    let mut pool = PoolingAllocationConfig::new();
    // Every slot of the pool is virtual address space reserved up front, committed only
    // when used. Room for POOL_INSTANCES calls of the largest component allowed (a v1 call
    // takes one core instance, one memory and up to four tables of the same room).
    pool.total_component_instances(POOL_INSTANCES)
        .total_core_instances(POOL_INSTANCES * MAX_CORE_INSTANCES_PER_COMPONENT)
        .total_memories(POOL_INSTANCES * MAX_MEMORIES_PER_COMPONENT)
        .total_tables(POOL_INSTANCES * MAX_TABLES_PER_COMPONENT)
        .max_core_instances_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
        .max_memories_per_component(MAX_MEMORIES_PER_COMPONENT)
        .max_tables_per_component(MAX_TABLES_PER_COMPONENT)
        .max_memories_per_module(1)
        .max_tables_per_module(4)
        .table_elements(MAX_TABLE_ELEMENTS)
        .max_memory_size(MAX_MEMORY_BYTES);
    let mut config = base_config();
    config.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    let engine = match Engine::new(&config) {
        Ok(engine) => engine,
        Err(pool_err) => {
            // A host that refuses the pool's virtual-memory reservation still works, with
            // an mmap per call instead of a reused slot.
            tracing::warn!(error = %pool_err, "policy plugins: pooling allocator unavailable, allocating on demand");
            Engine::new(&base_config()).map_err(|e| e.to_string())?
        }
    };
    Ok(Shared { engine, active: AtomicUsize::new(0), ticker: OnceLock::new() })
}

impl Shared {
    /// Marks a call as running (the ticker runs while any is) until the guard drops.
    pub(crate) fn running(&'static self) -> RunningGuard {
        self.active.fetch_add(1, Ordering::SeqCst);
        let thread = self.ticker.get_or_init(|| self.spawn_ticker());
        thread.unpark();
        RunningGuard { shared: self }
    }

    fn spawn_ticker(&'static self) -> Thread {
        let spawned = std::thread::Builder::new().name("gpuvisor-policy-epoch".into()).spawn(move || loop {
            if self.active.load(Ordering::SeqCst) == 0 {
                std::thread::park();
                continue;
            }
            std::thread::sleep(TICK);
            self.engine.increment_epoch();
        });
        match spawned {
            Ok(handle) => handle.thread().clone(),
            Err(e) => {
                // Without a ticker, deadlines cannot fire; fuel still bounds every call.
                tracing::error!(error = %e, "policy plugins: cannot start the epoch ticker; deadlines are enforced by fuel only");
                std::thread::current()
            }
        }
    }
}

/// Keeps the ticker running while alive.
pub(crate) struct RunningGuard {
    shared: &'static Shared,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.shared.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a sandbox instance is for: a call of a slot, or a load-time call. Each has its own
/// share of the pool (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Share {
    Slot(PolicyKind),
    Load,
}

/// The calls running in one share.
struct ShareState {
    running: Mutex<u32>,
    ended: Condvar,
}

impl ShareState {
    const fn new() -> ShareState {
        ShareState { running: Mutex::new(0), ended: Condvar::new() }
    }
}

static SHARE_STATES: [ShareState; SHARES as usize] =
    [ShareState::new(), ShareState::new(), ShareState::new(), ShareState::new()];

impl Share {
    fn state(self) -> &'static ShareState {
        let i = match self {
            Share::Slot(PolicyKind::Placement) => 0,
            Share::Slot(PolicyKind::Hypervisor) => 1,
            Share::Slot(PolicyKind::Grace) => 2,
            Share::Load => 3,
        };
        &SHARE_STATES[i]
    }

    /// `placement`, `hypervisor`, `grace` or `load`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Share::Slot(kind) => kind.as_str(),
            Share::Load => "load",
        }
    }

    /// A place in the share for one call, waiting at most `wait` for one to be free.
    /// `None`: the share stayed full ([`SLOT_CALLS`] calls) for all of `wait`.
    pub(crate) fn enter(self, wait: Duration) -> Option<ShareGuard> {
        let state = self.state();
        let until = Instant::now() + wait;
        let mut running = state.running.lock().unwrap_or_else(|p| p.into_inner());
        while *running >= SLOT_CALLS {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            running = state.ended.wait_timeout(running, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        *running += 1;
        Some(ShareGuard { state })
    }
}

/// One call's place in its share, given back on drop.
pub(crate) struct ShareGuard {
    state: &'static ShareState,
}

impl Drop for ShareGuard {
    fn drop(&mut self) {
        let mut running = self.state.running.lock().unwrap_or_else(|p| p.into_inner());
        *running = running.saturating_sub(1);
        self.state.ended.notify_one();
    }
}
