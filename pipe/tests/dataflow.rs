//! Dataflow between workers (§7 row 2 adapted, "Our choices" #2), the run record, the
//! gradients-final callback, and several stages on one worker.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use pipe::cpu::CpuTensor;
use pipe::{
    Action, Batch, Checkpoint, Error, Layer, Pass, Phase, Pipe, Schedule, ScheduleKind, SpanKind,
};

const M: usize = 4;

#[test]
fn a_fast_partition_never_waits_for_an_unrelated_slow_one() {
    // Partition 1 holds micro-batch 0 until partition 0 has run all M forwards. torchgpipe's
    // lock-step clocks would never let partition 0 get that far ahead (test_forward_lockstep);
    // dataflow does, and partition 1 still runs in micro-batch order.
    let log = new_log();
    let watched = log.clone();
    let layers: Vec<Box<dyn Layer<CpuTensor>>> = vec![
        Box::new(Probe::new(0, &log)),
        Box::new(Probe::with(1, &log, move |e| {
            if e.micro_batch != 0 {
                return Ok(());
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while events(&watched).iter().filter(|e| e.tag == 0).count() < M {
                if Instant::now() > deadline {
                    return Err(Error::custom("partition 0 was held back by partition 1"));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(())
        })),
    ];
    let mut pipe = Pipe::builder(layers, &[1, 1])
        .chunks(M)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    pipe.forward(Batch::single(data(M, 2, 1))).unwrap();
    let p1: Vec<usize> = events(&log)
        .iter()
        .filter(|e| e.tag == 1)
        .map(|e| e.micro_batch)
        .collect();
    assert_eq!(p1, (0..M).collect::<Vec<_>>());
}

#[test]
fn the_record_follows_the_schedule_and_the_data_dependencies() {
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
        let mut pipe = Pipe::builder(plain_model(), &[2, 2])
            .chunks(M)
            .checkpoint(Checkpoint::ExceptLast)
            .schedule(kind)
            .record(true)
            .build()
            .unwrap();
        let target = data(8, 3, 2);
        pipe.step(Batch::single(data(8, 5, 1)), |mb, y| mse(&target, mb, y))
            .unwrap();
        let record = pipe.take_record().unwrap();
        let schedule = kind.generate(M, 2).unwrap();
        assert_eq!(record.actions(), schedule.workers(), "{kind}");
        let find = |worker: usize, action: Action, kind: SpanKind| {
            *record.workers()[worker]
                .iter()
                .find(|s| s.action == action && s.kind == kind)
                .unwrap()
        };
        for (w, spans) in record.workers().iter().enumerate() {
            assert!(
                spans.windows(2).all(|p| p[0].end <= p[1].start),
                "worker {w} runs one thing at a time"
            );
            let recomputed: Vec<usize> = spans
                .iter()
                .filter(|s| s.kind == SpanKind::Recompute)
                .map(|s| s.action.micro_batch)
                .collect();
            let mut sorted = recomputed.clone();
            sorted.sort();
            assert_eq!(
                sorted,
                vec![0, 1, 2],
                "{kind}: except_last recomputes all but the last"
            );
        }
        assert_eq!(
            record.workers()[1]
                .iter()
                .filter(|s| s.kind == SpanKind::Loss)
                .count(),
            M
        );
        for i in 0..M {
            // Data flows forward from partition 0 to 1, gradients back from 1 to 0.
            assert!(
                find(1, Action::forward(1, i), SpanKind::Forward).start
                    >= find(0, Action::forward(0, i), SpanKind::Forward).end
            );
            let first_of_b0 = record.workers()[0]
                .iter()
                .find(|s| s.action == Action::backward(0, i))
                .unwrap();
            assert!(first_of_b0.start >= find(1, Action::backward(1, i), SpanKind::Backward).end);
        }
        assert!(record.makespan() > Duration::ZERO);
        // Taking the record starts a fresh one.
        assert!(pipe
            .take_record()
            .unwrap()
            .workers()
            .iter()
            .all(Vec::is_empty));
    }
}

#[test]
fn gradients_final_runs_once_per_partition_after_its_last_backward() {
    let log = new_log();
    let layers: Vec<Box<dyn Layer<CpuTensor>>> = (0..3)
        .map(|j| Box::new(Probe::new(j, &log)) as Box<dyn Layer<CpuTensor>>)
        .collect();
    let mut pipe = Pipe::builder(layers, &[1, 1, 1])
        .chunks(M)
        .schedule(ScheduleKind::OneFOneB)
        .build()
        .unwrap();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let (seen, watched) = (calls.clone(), log.clone());
    pipe.on_gradients_final(move |partition, layers| {
        let backwards = events(&watched)
            .iter()
            .filter(|e| e.tag == partition && e.phase == Phase::Backward)
            .count();
        seen.lock()
            .unwrap()
            .push((partition, layers.len(), backwards));
    });
    pipe.step(Batch::single(data(M, 2, 1)), sum_loss).unwrap();
    let mut got = calls.lock().unwrap().clone();
    got.sort();
    assert_eq!(got, vec![(0, 1, M), (1, 1, M), (2, 1, M)]);
    // A split GPipe run calls it after backward, not after forward.
    calls.lock().unwrap().clear();
    pipe.forward(Batch::single(data(M, 2, 1))).unwrap();
    assert!(calls.lock().unwrap().is_empty());
    pipe.backward(Batch::single(CpuTensor::ones(&[M, 2])))
        .unwrap();
    assert_eq!(calls.lock().unwrap().len(), 3);
}

#[test]
fn several_stages_on_one_worker_give_the_same_results() {
    // Four partitions on two workers (stages 0 and 2 on worker 0, 1 and 3 on worker 1),
    // backwards in reverse micro-batch order as GPipe: the same bits as GPipe on four.
    let f = Action::forward;
    let b = Action::backward;
    let list = |s: usize, t: usize| -> Vec<Action> {
        vec![
            f(s, 0),
            f(s, 1),
            f(t, 0),
            f(t, 1),
            b(t, 1),
            b(t, 0),
            b(s, 1),
            b(s, 0),
        ]
    };
    let interleaved = Schedule::new(4, 2, vec![list(0, 2), list(1, 3)]).unwrap();
    let run = |schedule: &Schedule| {
        let mut pipe = Pipe::builder(plain_model(), &[1, 1, 1, 1])
            .chunks(2)
            .seed(SEED)
            .build()
            .unwrap();
        let target = data(6, 3, 2);
        let out = pipe
            .step_with(schedule, Batch::single(data(6, 5, 1)), |mb, y| {
                mse(&target, mb, y)
            })
            .unwrap();
        (out.output, out.input_grad, grads(&pipe.into_layers()))
    };
    assert_eq!(run(&interleaved), run(&Schedule::gpipe(2, 4).unwrap()));
    // A schedule of the wrong shape is refused before anything runs.
    let mut pipe = Pipe::builder(plain_model(), &[2, 2])
        .chunks(2)
        .build()
        .unwrap();
    let err = pipe
        .step_with(&interleaved, Batch::single(data(6, 5, 1)), sum_loss)
        .unwrap_err();
    assert!(matches!(
        err,
        Error::ScheduleMismatch {
            schedule_stages: 4,
            stages: 2,
            ..
        }
    ));
    assert!(interleaved.workers()[0]
        .iter()
        .any(|a| a.pass == Pass::Backward));
}
