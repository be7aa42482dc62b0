//! The schedule simulator: textbook bubbles and memory, message costs on the critical
//! path, typed errors, and costs measured from a real step.

use pipe::cpu::{CpuTensor, Linear, ReLU};
use pipe::simulate::{simulate, Costs, CostsError, StageCosts};
use pipe::{Action, Batch, Checkpoint, Error, Layer, Pass, Pipe, Schedule, ScheduleKind};

fn costs_error(e: Error) -> CostsError {
    match e {
        Error::Custom(e) => e
            .downcast_ref::<CostsError>()
            .cloned()
            .expect("a CostsError"),
        other => panic!("expected a CostsError, got {other:?}"),
    }
}

#[test]
fn gpipe_and_1f1b_have_the_textbook_bubble_with_equal_forward_and_backward() {
    for n in [2, 4, 8] {
        let costs = Costs::uniform(n, 1.0, 1.0, 0.0).unwrap();
        for m in 1..=16 {
            let expected = (n - 1) as f64 / (m + n - 1) as f64;
            for (name, schedule) in [
                ("gpipe", Schedule::gpipe(m, n).unwrap()),
                ("1f1b", Schedule::one_f_one_b(m, n).unwrap()),
            ] {
                let sim = simulate(&schedule, &costs).unwrap();
                assert!(
                    (sim.bubble() - expected).abs() < 1e-9,
                    "{name} n={n} m={m}: bubble {} vs {expected}",
                    sim.bubble()
                );
                assert!((sim.makespan - 2.0 * (m + n - 1) as f64).abs() < 1e-9);
                assert!(sim.busy.iter().all(|&b| (b - 2.0 * m as f64).abs() < 1e-9));
            }
        }
    }
}

#[test]
fn a_message_cost_adds_on_the_critical_path() {
    // GPipe, 2 stages, 2 micro-batches, F = 1, B = 2, each message 0.5.
    // Stage 0: F0 [0,1] F1 [1,2]; stage 1: F0 [1.5,2.5] F1 [2.5,3.5] B1 [3.5,5.5]
    // B0 [5.5,7.5]; stage 0: B1 [6,8] (5.5 + 0.5) B0 [8,10].
    let schedule = Schedule::gpipe(2, 2).unwrap();
    let costs = Costs::uniform(2, 1.0, 2.0, 0.5).unwrap();
    let sim = simulate(&schedule, &costs).unwrap();
    let at = |a: Action| {
        let t = sim.timing(a).unwrap();
        (t.start, t.end)
    };
    assert_eq!(at(Action::forward(0, 1)), (1.0, 2.0));
    assert_eq!(at(Action::forward(1, 0)), (1.5, 2.5));
    assert_eq!(at(Action::forward(1, 1)), (2.5, 3.5));
    assert_eq!(at(Action::backward(1, 0)), (5.5, 7.5));
    assert_eq!(at(Action::backward(0, 1)), (6.0, 8.0));
    assert_eq!(at(Action::backward(0, 0)), (8.0, 10.0));
    assert_eq!(sim.makespan, 10.0);
    // Without messages: 9; each direction's cost counts once on the critical path.
    let free = simulate(&schedule, &Costs::uniform(2, 1.0, 2.0, 0.0).unwrap()).unwrap();
    assert_eq!(free.makespan, 9.0);
    // Only the activation costs: 9.5.
    let mut one_way = Costs::uniform(2, 1.0, 2.0, 0.0).unwrap().stages().to_vec();
    one_way[0].send_activation = 0.5;
    let sim = simulate(&schedule, &Costs::new(one_way).unwrap()).unwrap();
    assert_eq!(sim.makespan, 9.5);
    assert_eq!(sim.busy, vec![6.0, 6.0]);
}

#[test]
fn stages_on_one_worker_exchange_for_free() {
    let schedule = Schedule::new(
        2,
        1,
        vec![vec![
            Action::forward(0, 0),
            Action::forward(1, 0),
            Action::backward(1, 0),
            Action::backward(0, 0),
        ]],
    )
    .unwrap();
    let sim = simulate(&schedule, &Costs::uniform(2, 1.0, 2.0, 5.0).unwrap()).unwrap();
    assert_eq!(sim.makespan, 6.0);
    assert_eq!(sim.bubble(), 0.0);
    assert_eq!(sim.peak_micro_batches, vec![2]);
    assert_eq!(sim.stage_peak_micro_batches, vec![1, 1]);
}

#[test]
fn peak_memory_is_n_minus_j_for_1f1b_and_m_for_gpipe() {
    for n in [2, 4, 8] {
        for m in n..=16 {
            let bytes: Vec<u64> = (0..n as u64).map(|s| 100 + s).collect();
            let costs = Costs::uniform(n, 1.0, 2.0, 0.1)
                .unwrap()
                .with_activation_bytes(&bytes)
                .unwrap();
            let sim = simulate(&Schedule::one_f_one_b(m, n).unwrap(), &costs).unwrap();
            let expected: Vec<usize> = (0..n).map(|j| n - j).collect();
            assert_eq!(sim.stage_peak_micro_batches, expected, "1f1b n={n} m={m}");
            assert_eq!(sim.peak_micro_batches, expected);
            let expected_bytes: Vec<u64> = (0..n).map(|j| (n - j) as u64 * bytes[j]).collect();
            assert_eq!(sim.peak_bytes, Some(expected_bytes));

            let sim = simulate(&Schedule::gpipe(m, n).unwrap(), &costs).unwrap();
            assert_eq!(
                sim.stage_peak_micro_batches,
                vec![m; n],
                "gpipe n={n} m={m}"
            );
            assert_eq!(sim.peak_micro_batches, vec![m; n]);
        }
    }
    // Without bytes, no byte peak.
    let sim = simulate(
        &Schedule::gpipe(2, 2).unwrap(),
        &Costs::uniform(2, 1.0, 1.0, 0.0).unwrap(),
    )
    .unwrap();
    assert_eq!(sim.peak_bytes, None);
}

#[test]
fn split_backwards_keep_memory_until_the_weight_gradient() {
    // Two stages, two micro-batches, each on its own worker: F F I I W W per worker
    // (stage 1 first its forwards). I keeps the micro-batch, W frees it.
    let list = |s: usize| {
        vec![
            Action::forward(s, 0),
            Action::forward(s, 1),
            Action::input_grad(s, 0),
            Action::input_grad(s, 1),
            Action::weight_grad(s, 0),
            Action::weight_grad(s, 1),
        ]
    };
    let schedule = Schedule::new(2, 2, vec![list(0), list(1)]).unwrap();
    let costs = Costs::uniform(2, 1.0, 2.0, 0.0).unwrap();
    let sim = simulate(&schedule, &costs).unwrap();
    assert_eq!(sim.stage_peak_micro_batches, vec![2, 2]);
    // Stage 1: F0 [1,2] F1 [2,3] I0 [3,4] I1 [4,5] W0 [5,6] W1 [6,7];
    // stage 0: F [0,2], I0 [4,5] (after I(1,0)), I1 [5,6], W0 [6,7], W1 [7,8].
    assert_eq!(sim.timing(Action::input_grad(0, 0)).unwrap().start, 4.0);
    assert_eq!(sim.timing(Action::weight_grad(0, 1)).unwrap().end, 8.0);
    assert_eq!(sim.makespan, 8.0);
    // Without costs for I, an error naming it.
    let mut no_i = costs.stages().to_vec();
    no_i[1].input_grad = None;
    let e = simulate(&schedule, &Costs::new(no_i).unwrap()).unwrap_err();
    assert_eq!(
        costs_error(e),
        CostsError::MissingCost {
            stage: 1,
            pass: Pass::InputGrad
        }
    );
}

#[test]
fn mismatched_costs_are_typed_errors() {
    let schedule = Schedule::gpipe(4, 3).unwrap();
    let e = simulate(&schedule, &Costs::uniform(2, 1.0, 1.0, 0.0).unwrap()).unwrap_err();
    let e = costs_error(e);
    assert_eq!(
        e,
        CostsError::StageCount {
            schedule: 3,
            costs: 2
        }
    );
    assert!(e.to_string().contains("stage 2"), "{e}");

    let mut missing = Costs::uniform(3, 1.0, 1.0, 0.0).unwrap().stages().to_vec();
    missing[2].backward = None;
    let e = simulate(&schedule, &Costs::new(missing).unwrap()).unwrap_err();
    let e = costs_error(e);
    assert_eq!(
        e,
        CostsError::MissingCost {
            stage: 2,
            pass: Pass::Backward
        }
    );
    assert!(e.to_string().contains("stage 2"), "{e}");

    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let e = Costs::uniform(3, bad, 1.0, 0.0).unwrap_err();
        assert!(matches!(
            costs_error(e),
            CostsError::InvalidCost {
                stage: 0,
                what: "forward",
                ..
            }
        ));
    }
    let e = Costs::uniform(3, 1.0, 1.0, 0.0)
        .unwrap()
        .with_activation_bytes(&[1, 2])
        .unwrap_err();
    assert_eq!(
        costs_error(e),
        CostsError::BytesCount {
            stages: 3,
            bytes: 2
        }
    );
    // A forward-only schedule needs no backward cost.
    let forward_only = vec![
        StageCosts {
            forward: Some(1.0),
            ..StageCosts::default()
        };
        3
    ];
    let sim = simulate(
        &Schedule::gpipe_forward(4, 3).unwrap(),
        &Costs::new(forward_only).unwrap(),
    )
    .unwrap();
    assert_eq!(sim.makespan, 6.0);
}

fn model() -> Vec<Box<dyn Layer<CpuTensor>>> {
    vec![
        Box::new(Linear::new(192, 192, 1)),
        Box::new(ReLU),
        Box::new(Linear::new(192, 192, 2)),
        Box::new(ReLU),
        Box::new(Linear::new(192, 192, 3)),
        Box::new(Linear::new(192, 8, 4)),
    ]
}

#[test]
fn costs_from_a_recorded_step_predict_its_makespan() {
    const M: usize = 4;
    for (kind, checkpoint) in [
        (ScheduleKind::GPipe, Checkpoint::ExceptLast),
        (ScheduleKind::OneFOneB, Checkpoint::Never),
    ] {
        let mut pipe = Pipe::builder(model(), &[3, 3])
            .chunks(M)
            .checkpoint(checkpoint)
            .schedule(kind)
            .record(true)
            .build()
            .unwrap();
        let x = CpuTensor::from_shape_vec(
            &[256, 192],
            (0..256 * 192)
                .map(|v| (v % 97) as f32 / 97.0 - 0.5)
                .collect(),
        )
        .unwrap();
        let step = |pipe: &mut Pipe<CpuTensor>| {
            pipe.step(Batch::single(x.clone()), |_mb, out| {
                let y = out.tensor(0)?;
                Ok((y.array().sum(), Batch::single(CpuTensor::ones(y.shape()))))
            })
            .unwrap();
        };
        step(&mut pipe); // warm up
        pipe.take_record();
        step(&mut pipe);
        let record = pipe.take_record().unwrap();
        let schedule = kind.generate(M, 2).unwrap();
        let costs = Costs::from_record(&record, &schedule).unwrap();
        for (s, c) in costs.stages().iter().enumerate() {
            for pass in [Pass::Forward, Pass::Backward] {
                let cost = c.of(pass).unwrap();
                assert!(cost > 0.0, "{kind}: stage {s} {pass:?} cost {cost}");
            }
            assert_eq!(c.input_grad, None);
            assert!(c.send_activation >= 0.0 && c.send_gradient >= 0.0);
        }
        let sim = simulate(&schedule, &costs).unwrap();
        let recorded = record.makespan().as_secs_f64();
        eprintln!(
            "{kind}: simulated {:.6} s, recorded {recorded:.6} s",
            sim.makespan
        );
        assert!(
            sim.makespan <= 2.0 * recorded && recorded <= 2.0 * sim.makespan,
            "{kind}: simulated {} s, recorded {recorded} s",
            sim.makespan
        );
    }
}

#[test]
fn costs_from_a_record_of_another_schedule_are_errors() {
    let mut pipe = Pipe::builder(model(), &[3, 3])
        .chunks(4)
        .record(true)
        .build()
        .unwrap();
    let x = CpuTensor::from_shape_vec(&[8, 192], vec![0.1; 8 * 192]).unwrap();
    pipe.forward(Batch::single(x)).unwrap();
    let record = pipe.take_record().unwrap();
    // Forwards only: no backward span for a schedule with backwards.
    let e = Costs::from_record(&record, &Schedule::gpipe(4, 2).unwrap()).unwrap_err();
    assert_eq!(
        costs_error(e),
        CostsError::NoSpans {
            stage: 0,
            pass: Pass::Backward
        }
    );
    // Micro-batches the schedule does not have.
    let e = Costs::from_record(&record, &Schedule::gpipe(2, 2).unwrap()).unwrap_err();
    assert!(matches!(costs_error(e), CostsError::NotInSchedule { .. }));
    // The forward half is fine.
    let costs = Costs::from_record(&record, &Schedule::gpipe_forward(4, 2).unwrap()).unwrap();
    assert!(costs.stages().iter().all(|c| c.forward.unwrap() > 0.0));
}

#[test]
fn simulated_bubbles_follow_the_textbook_formulas_on_4_and_8_workers() {
    use pipe::ScheduleKind;
    for pp in [4usize, 8] {
        for m in [pp, 2 * pp, 4 * pp] {
            // GPipe: (n − 1) / (m + n − 1).
            let n = pp;
            let costs = Costs::uniform(n, 1.0, 2.0, 0.0).unwrap();
            let sim = simulate(&ScheduleKind::GPipe.generate(m, n).unwrap(), &costs).unwrap();
            let want = (n - 1) as f64 / (m + n - 1) as f64;
            assert!(
                (sim.bubble() - want).abs() <= 0.02,
                "gpipe pp {pp} m {m}: {} vs {want}",
                sim.bubble()
            );
            // Interleaved 1F1B, v = 2 stages per worker: (pp − 1) / (v·m + pp − 1).
            let v = 2;
            let kind = ScheduleKind::Interleaved1F1B {
                stages_per_worker: v,
            };
            let costs = Costs::uniform(v * pp, 1.0, 2.0, 0.0).unwrap();
            let sim = simulate(&kind.generate(m, v * pp).unwrap(), &costs).unwrap();
            let want = (pp - 1) as f64 / (v * m + pp - 1) as f64;
            assert!(
                (sim.bubble() - want).abs() <= 0.02,
                "interleaved pp {pp} m {m}: {} vs {want}",
                sim.bubble()
            );
        }
    }
}
