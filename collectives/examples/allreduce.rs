//! Four ranks as threads of one process average their gradients, then show what the
//! guarantees look like when one rank fails.
//!
//! ```sh
//! cargo run -p collectives --example allreduce
//! ```

use collectives::{run_local, run_local_with_timeout, Buffer, ProcessGroup, ReduceOp};
use std::time::Duration;

fn main() -> collectives::Result<()> {
    // Each rank holds a "gradient" filled with its rank number; the average is 1.5.
    let results = run_local(4, |group| {
        let grad = Buffer::F32(vec![group.rank() as f32; 8]);
        group.all_reduce(grad, ReduceOp::Avg).wait()
    })?;
    for (rank, r) in results.into_iter().enumerate() {
        println!("rank {rank}: {:?}", r??);
    }

    // Rank 2 panics; the others' all-reduce fails with PeerLost instead of hanging.
    let results = run_local_with_timeout(3, Duration::from_secs(2), |group| {
        if group.rank() == 2 {
            panic!("rank 2 ran out of memory");
        }
        group
            .all_reduce(Buffer::F32(vec![1.0; 8]), ReduceOp::Sum)
            .wait()
    })?;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(Ok(_)) => println!("rank {rank}: ok"),
            Ok(Err(e)) | Err(e) => println!("rank {rank}: {e}"),
        }
    }
    Ok(())
}
