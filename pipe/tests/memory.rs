//! Memory held between forward and backward, summed over partitions and counted through
//! the tensor trait: `always` holds only the micro-batch inputs, `never` every saved
//! activation, and 1F1B bounds what `never` holds by the number of partitions instead of
//! the number of micro-batches.
//!
//! Run with `--nocapture` to print the figures.

mod common;

use common::*;
use pipe::cpu::{CpuTensor, Dropout, Linear, ReLU};
use pipe::{Batch, Checkpoint, Layer, MicroBatch, Pipe, ScheduleKind};

const BATCH: usize = 32;
const M: usize = 16;
const BALANCE: [usize; 2] = [2, 3];

fn model() -> Vec<Box<dyn Layer<CpuTensor>>> {
    vec![
        Box::new(Linear::new(8, 16, 1)),
        Box::new(ReLU),
        Box::new(Linear::new(16, 16, 2)),
        Box::new(Dropout::new(0.2).unwrap()),
        Box::new(ReLU),
    ]
}

/// Per partition, per micro-batch: (bytes of the partition's input, bytes of its layers'
/// saved states), from the unpipelined reference.
fn per_micro_batch() -> Vec<Vec<(usize, usize)>> {
    let mut layers = model();
    let plan = MicroBatch::plan(BATCH, M).unwrap();
    let order: Vec<usize> = (0..M).collect();
    let r = reference(
        &mut layers,
        &data(BATCH, 8, 1),
        &data(BATCH, 16, 2),
        &plan,
        &order,
        0,
    );
    let mut first = 0;
    BALANCE
        .iter()
        .map(|&size| {
            let rows = (0..M)
                .map(|i| {
                    (
                        r.input_bytes[i][first],
                        r.saved_bytes[i][first..first + size].iter().sum(),
                    )
                })
                .collect();
            first += size;
            rows
        })
        .collect()
}

fn pipe(mode: Checkpoint, kind: ScheduleKind) -> Pipe<CpuTensor> {
    Pipe::builder(model(), &BALANCE)
        .chunks(M)
        .checkpoint(mode)
        .schedule(kind)
        .seed(SEED)
        .build()
        .unwrap()
}

/// Held bytes per partition after a GPipe `forward`, then checks `backward` releases all.
fn held_after_forward(mode: Checkpoint) -> Vec<usize> {
    let mut p = pipe(mode, ScheduleKind::GPipe);
    p.forward(Batch::single(data(BATCH, 8, 1))).unwrap();
    let held: Vec<usize> = p.memory().iter().map(|m| m.held).collect();
    assert_eq!(held, p.memory().iter().map(|m| m.peak).collect::<Vec<_>>());
    p.backward(Batch::single(CpuTensor::ones(&[BATCH, 16])))
        .unwrap();
    assert!(
        p.memory().iter().all(|m| m.held == 0),
        "{mode}: backward releases everything"
    );
    held
}

/// Peak held bytes per partition over a whole `step`.
fn step_peak(mode: Checkpoint, kind: ScheduleKind) -> Vec<usize> {
    let mut p = pipe(mode, kind);
    let target = data(BATCH, 16, 2);
    p.step(Batch::single(data(BATCH, 8, 1)), |mb, y| {
        mse(&target, mb, y)
    })
    .unwrap();
    assert!(p.memory().iter().all(|m| m.held == 0));
    p.memory().iter().map(|m| m.peak).collect()
}

#[test]
fn held_bytes_per_checkpoint_mode() {
    let rows = per_micro_batch();
    let inputs: Vec<usize> = rows.iter().map(|r| r.iter().map(|x| x.0).sum()).collect();
    let saved: Vec<usize> = rows.iter().map(|r| r.iter().map(|x| x.1).sum()).collect();
    let except_last: Vec<usize> = rows
        .iter()
        .map(|r| r[..M - 1].iter().map(|x| x.0).sum::<usize>() + r[M - 1].1)
        .collect();
    assert_eq!(
        held_after_forward(Checkpoint::Always),
        inputs,
        "always: the inputs only"
    );
    assert_eq!(
        held_after_forward(Checkpoint::Never),
        saved,
        "never: every activation"
    );
    assert_eq!(held_after_forward(Checkpoint::ExceptLast), except_last);
    // Saved activations outweigh the inputs here, which is the point of checkpointing.
    assert!(inputs.iter().sum::<usize>() < saved.iter().sum::<usize>());
    println!("GPipe forward, m = {M}, balance {BALANCE:?}: bytes held per partition");
    println!(
        "  always      {inputs:?} = {}",
        inputs.iter().sum::<usize>()
    );
    println!(
        "  except_last {except_last:?} = {}",
        except_last.iter().sum::<usize>()
    );
    println!("  never       {saved:?} = {}", saved.iter().sum::<usize>());
}

#[test]
fn one_f_one_b_bounds_held_activations_by_the_partition_count() {
    let rows = per_micro_batch();
    let one_micro_batch: usize = rows.iter().map(|r| r[0].1).sum();
    for mode in [
        Checkpoint::Never,
        Checkpoint::ExceptLast,
        Checkpoint::Always,
    ] {
        let gpipe = step_peak(mode, ScheduleKind::GPipe);
        let one = step_peak(mode, ScheduleKind::OneFOneB);
        let (g, o): (usize, usize) = (gpipe.iter().sum(), one.iter().sum());
        println!("step peak, {mode}: GPipe {gpipe:?} = {g}, 1F1B {one:?} = {o}");
        // Partition j of n holds at most n - j micro-batches: 2 on partition 0, 1 on 1.
        let n = BALANCE.len();
        for (j, r) in rows.iter().enumerate() {
            let most = r.iter().map(|x| x.0.max(x.1)).max().unwrap();
            assert!(
                one[j] <= (n - j) * most,
                "{mode}, partition {j}: {} > {} x {most}",
                one[j],
                n - j
            );
        }
        if mode == Checkpoint::Never {
            assert!(
                o * M <= 2 * g + M * one_micro_batch,
                "1F1B {o} vs GPipe {g}"
            );
        }
    }
}
