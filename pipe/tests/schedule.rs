//! Schedules as data: the clock schedule (§7 row 1), the generators, and the validator's
//! rejections (row 21's ordering rules, adapted: without autograd the backward order is in
//! the schedule, so the validator is what keeps it).

use pipe::{clock_cycles, Action, Error, Pass, Schedule, ScheduleKind};

#[test]
fn clock_cycles_match_torchgpipe() {
    assert_eq!(clock_cycles(1, 1), vec![vec![(0, 0)]]);
    assert_eq!(
        clock_cycles(1, 3),
        vec![vec![(0, 0)], vec![(0, 1)], vec![(0, 2)]]
    );
    assert_eq!(
        clock_cycles(3, 1),
        vec![vec![(0, 0)], vec![(1, 0)], vec![(2, 0)]]
    );
    assert_eq!(
        clock_cycles(3, 3),
        vec![
            vec![(0, 0)],
            vec![(1, 0), (0, 1)],
            vec![(2, 0), (1, 1), (0, 2)],
            vec![(2, 1), (1, 2)],
            vec![(2, 2)],
        ]
    );
    assert_eq!(
        clock_cycles(4, 2),
        vec![
            vec![(0, 0)],
            vec![(1, 0), (0, 1)],
            vec![(2, 0), (1, 1)],
            vec![(3, 0), (2, 1)],
            vec![(3, 1)],
        ]
    );
    // m + n - 1 clocks, each stage busy in m of them: the bubble (n-1)/(m+n-1).
    for (m, n) in [(8, 2), (5, 4), (1, 6)] {
        let clocks = clock_cycles(m, n);
        assert_eq!(clocks.len(), m + n - 1);
        for j in 0..n {
            assert_eq!(
                clocks
                    .iter()
                    .filter(|c| c.iter().any(|&(_, s)| s == j))
                    .count(),
                m
            );
        }
    }
}

#[test]
fn gpipe_runs_forwards_in_clock_order_then_backwards_in_reverse() {
    let s = Schedule::gpipe(3, 2).unwrap();
    let f = Action::forward;
    let b = Action::backward;
    assert_eq!(
        s.workers(),
        &[
            vec![f(0, 0), f(0, 1), f(0, 2), b(0, 2), b(0, 1), b(0, 0)],
            vec![f(1, 0), f(1, 1), f(1, 2), b(1, 2), b(1, 1), b(1, 0)],
        ]
    );
    assert!(s.has_forward() && s.has_backward());
    let halves = (
        Schedule::gpipe_forward(3, 2).unwrap(),
        Schedule::gpipe_backward(3, 2).unwrap(),
    );
    assert!(!halves.0.has_backward() && !halves.1.has_forward());
    assert_eq!(
        halves.1.max_in_flight(0),
        3,
        "a backward-only schedule starts with all held"
    );
}

#[test]
fn one_f_one_b_alternates_after_warm_up_and_bounds_in_flight() {
    let s = Schedule::one_f_one_b(4, 3).unwrap();
    let f = Action::forward;
    let b = Action::backward;
    assert_eq!(
        s.workers()[0],
        vec![
            f(0, 0),
            f(0, 1),
            f(0, 2),
            b(0, 0),
            f(0, 3),
            b(0, 1),
            b(0, 2),
            b(0, 3)
        ]
    );
    assert_eq!(
        s.workers()[2],
        vec![
            f(2, 0),
            b(2, 0),
            f(2, 1),
            b(2, 1),
            f(2, 2),
            b(2, 2),
            f(2, 3),
            b(2, 3)
        ]
    );
    for (m, n) in [(1, 1), (1, 4), (3, 5), (8, 2), (16, 2), (16, 4)] {
        let one = Schedule::one_f_one_b(m, n).unwrap();
        let gpipe = Schedule::gpipe(m, n).unwrap();
        for j in 0..n {
            assert!(one.max_in_flight(j) <= n - j, "(m {m}, n {n}) stage {j}");
            assert_eq!(one.max_in_flight(j), (n - j).min(m));
            assert_eq!(gpipe.max_in_flight(j), m);
        }
    }
    assert_eq!(
        "1f1b".parse::<ScheduleKind>().unwrap(),
        ScheduleKind::OneFOneB
    );
    assert_eq!(
        "pipedream".parse::<ScheduleKind>().unwrap_err().to_string(),
        "schedule: \"pipedream\" is not one of gpipe, 1f1b, zb, looped_bfs[:V], \
         interleaved_1f1b[:V], interleaved_zb[:V], zbv, dualpipev (or PyTorch's class names)"
    );
}

#[test]
fn validator_rejects_backward_before_forward() {
    let f = Action::forward;
    let b = Action::backward;
    let err = Schedule::new(1, 2, vec![vec![f(0, 0), b(0, 1), f(0, 1), b(0, 0)]]).unwrap_err();
    assert!(
        matches!(err, Error::BackwardBeforeForward { worker: 0, action } if action == b(0, 1)),
        "{err}"
    );
}

#[test]
fn validator_rejects_a_cross_worker_cycle() {
    let f = Action::forward;
    let b = Action::backward;
    // Stage 1 wants micro-batch 1 before 0, stage 0 sends 0 first but then waits on the
    // backward of 0, which stage 1 runs only after forward 1, which needs stage 0's
    // forward 1, which comes after that backward.
    let err = Schedule::new(
        2,
        2,
        vec![
            vec![f(0, 0), b(0, 0), f(0, 1), b(0, 1)],
            vec![f(1, 1), f(1, 0), b(1, 0), b(1, 1)],
        ],
    )
    .unwrap_err();
    match err {
        Error::Deadlock { waiting, grid } => {
            assert_eq!(waiting, vec![(0, b(0, 0)), (1, f(1, 1))]);
            assert_eq!(
                grid,
                "  worker 0: 0F0 >0B0< 0F1 0B1\n  worker 1: >1F1< 1F0 1B0 1B1\n"
            );
        }
        other => panic!("expected a deadlock, got {other}"),
    }
    // The same actions in a runnable order pass.
    Schedule::new(
        2,
        2,
        vec![
            vec![f(0, 0), f(0, 1), b(0, 0), b(0, 1)],
            vec![f(1, 1), f(1, 0), b(1, 0), b(1, 1)],
        ],
    )
    .unwrap();
}

#[test]
fn validator_rejects_malformed_schedules() {
    let f = Action::forward;
    let b = Action::backward;
    assert!(matches!(
        Schedule::new(0, 1, vec![]),
        Err(Error::ScheduleEmpty { .. })
    ));
    assert!(matches!(
        Schedule::new(1, 1, vec![vec![f(0, 0), f(0, 3)]]),
        Err(Error::ActionOutOfRange { .. })
    ));
    assert!(matches!(
        Schedule::new(1, 1, vec![vec![f(0, 0), f(0, 0)]]),
        Err(Error::DuplicateAction { .. })
    ));
    assert!(matches!(
        Schedule::new(1, 2, vec![vec![f(0, 0), b(0, 0)]]),
        Err(Error::MissingAction { action }) if action == f(0, 1)
    ));
    assert!(matches!(
        Schedule::new(1, 2, vec![vec![f(0, 0)], vec![f(0, 1)]]),
        Err(Error::StageSplit {
            stage: 0,
            first: 0,
            second: 1
        })
    ));
    assert!(matches!(
        Schedule::new(2, 1, vec![vec![f(0, 0), b(0, 0)], vec![f(1, 0)]]),
        Err(Error::MissingAction { action }) if action == b(1, 0)
    ));
}

#[test]
fn one_worker_may_host_several_stages() {
    // An interleaved-style placement: stages 0 and 2 on worker 0, 1 and 3 on worker 1.
    let s = Schedule::new(
        4,
        1,
        vec![
            vec![
                Action::forward(0, 0),
                Action::forward(2, 0),
                Action::backward(2, 0),
                Action::backward(0, 0),
            ],
            vec![
                Action::forward(1, 0),
                Action::forward(3, 0),
                Action::backward(3, 0),
                Action::backward(1, 0),
            ],
        ],
    )
    .unwrap();
    assert_eq!((s.worker_of(2), s.worker_of(3)), (Some(0), Some(1)));
    assert_eq!(
        s.workers()[0]
            .iter()
            .filter(|a| a.pass == Pass::Backward)
            .count(),
        2
    );
}
