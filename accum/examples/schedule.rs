//! Prints what `Accumulator` decides for each micro-step of two epochs of 10 batches with
//! groups of 4: which steps communicate, the loss scale, and when the optimizer steps.
//!
//! ```sh
//! cargo run -p accum --example schedule
//! ```

use accum::{Accumulator, GradSync};

/// A data-parallel engine's switch; a real one is `ddp-hooks`' reducer.
struct Engine {
    sync: bool,
}

impl GradSync for Engine {
    fn set_sync(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.sync, on)
    }
    fn sync_enabled(&self) -> bool {
        self.sync
    }
}

fn main() -> Result<(), accum::Error> {
    let mut engine = Engine { sync: true };
    let mut acc = Accumulator::new(4)?;
    for epoch in 0..2 {
        for (step, batch) in acc.epoch(0..10) {
            let model = step.apply(&mut engine);
            let comm = if model.sync_enabled() {
                "all-reduce"
            } else {
                "local"
            };
            drop(model);
            let opt = step.optimizer_step(|| "optimizer step").unwrap_or("");
            println!(
                "epoch {epoch} batch {batch}: {comm:<10} loss x {:.2} {opt}",
                step.loss_scale()
            );
        }
    }
    Ok(())
}
