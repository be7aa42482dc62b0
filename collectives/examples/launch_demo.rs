//! One rank of a job started by `launch`: reads its place from the environment, meets
//! the others at a barrier of the rendezvous store, and says so.
//!
//! ```text
//! cargo build -p collectives --bins --examples
//! target/debug/launch -n 3 -- target/debug/examples/launch_demo
//! ```

use std::time::Duration;

use collectives::env::EnvInfo;

fn main() -> collectives::Result<()> {
    let info = EnvInfo::from_env()?;
    let store = info.connect_store(Duration::from_secs(30))?;
    store.barrier(
        "launch_demo",
        info.world_size,
        info.rank,
        Duration::from_secs(30),
    )?;
    println!(
        "rank {} of {} (local rank {}) passed the barrier",
        info.rank, info.world_size, info.local_rank
    );
    Ok(())
}
