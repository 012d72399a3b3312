//! The process-wide wasmtime engine every plugin is compiled for, and its epoch ticker.
//!
//! One engine (fuel and epoch interruption on, pooling instance allocator) is created on
//! first use. One ticker thread increments the engine's epoch every [`TICK`] while at
//! least one call is running, and parks otherwise, so an idle agent pays nothing.
//! A call's wall-clock deadline is a number of ticks (see [`deadline_ticks`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::Duration;
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

/// The epoch tick: the resolution of call deadlines.
pub const TICK: Duration = Duration::from_millis(1);

/// The largest memory any plugin may be allowed (`Limits::memory_bytes` is capped to it):
/// the size of a pooled memory slot.
pub const MAX_MEMORY_BYTES: usize = 256 << 20;

/// How many plugin instances may be alive at once (concurrent calls, all plugins): v1
/// module instances, and v2 component instances.
pub const POOL_INSTANCES: u32 = 64;

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
    // when used: core instances (and their memories and tables) for v1 calls and for the
    // core instances inside components.
    let core = POOL_INSTANCES * 4;
    pool.total_component_instances(POOL_INSTANCES)
        .total_core_instances(core)
        .total_memories(core)
        .total_tables(core)
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

/// The number of ticks for a deadline, rounded up, at least 1.
pub(crate) fn deadline_ticks(deadline: Duration) -> u64 {
    let tick = TICK.as_nanos().max(1);
    let ticks = deadline.as_nanos().div_ceil(tick);
    u64::try_from(ticks).unwrap_or(u64::MAX).max(1)
}
