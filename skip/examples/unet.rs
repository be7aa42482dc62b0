//! A U-Net-like stack of 8 layers with nested skips (0->6, 1->5, 2->4, one encoder and
//! one decoder block type isolated into three namespaces), run forward and backward on a
//! plain sequence with `skip`, and compared with the same model whose residuals are
//! threaded explicitly through every layer's output.
//!
//! ```sh
//! cargo run -p skip --example unet
//! ```
//!
//! Prints both outputs and gradients and exits with status 1 if any output or gradient
//! differs (they must be identical to the bit: the arithmetic is the same).

#[path = "model/mod.rs"]
mod model;

use model::{differences, run_explicit, run_with_skip, Model, Rng};

fn main() {
    let model = Model::unet(4, 7);
    if let Err(e) = skip::verify(&model.decls()) {
        eprintln!("{e}");
        std::process::exit(1);
    }

    let mut rng = Rng::new(11);
    let mut failed = false;
    for micro_batch in 0..3 {
        let x = rng.vec(4);
        let (with_skip, tracker) = match run_with_skip(&model, x.clone()) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("micro-batch {micro_batch}: {e}");
                std::process::exit(1);
            }
        };
        let explicit = run_explicit(&model, x);
        println!("micro-batch {micro_batch}");
        println!("  output     skip {:?}", with_skip.output);
        println!("         explicit {:?}", explicit.output);
        println!("  input grad skip {:?}", with_skip.input_grad);
        println!("         explicit {:?}", explicit.input_grad);
        let diff = differences(&with_skip, &explicit);
        if diff.is_empty() {
            println!(
                "  identical: output, input gradient and all {} parameter gradients",
                3 * with_skip.param_grads.len()
            );
        } else {
            println!("  DIFFERENT: {}", diff.join(", "));
            failed = true;
        }
        if !tracker.is_empty() {
            println!(
                "  tracker still holds {} values or gradients",
                tracker.len()
            );
            failed = true;
        }
    }
    if failed {
        std::process::exit(1);
    }
}
