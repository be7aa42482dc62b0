//! PyTorch's multi-stage schedules (`pipe::{looped_bfs, interleaved_1f1b, ...}`) against
//! the orders PyTorch 2.15 generates, their CSV both ways, and their validity as
//! [`Schedule`]s.

use pipe::{
    dual_pipe_v, interleaved_1f1b, interleaved_zero_bubble, loop_placement, looped_bfs,
    v_placement, zb_h1, zbv, Action, Cell, Error, Order, Schedule,
};

/// A grid in the reference's notation (`.` a bubble, `a+b` an overlap), one string per
/// rank, read through the CSV cell parser.
fn grid(rows: &[&str]) -> Order {
    let csv: Vec<String> = rows
        .iter()
        .map(|row| {
            row.split_whitespace()
                .map(|cell| match cell {
                    "." => String::new(),
                    c => match c.split_once('+') {
                        Some((f, b)) => format!("({f};{b})OVERLAP_F_B"),
                        None => c.to_string(),
                    },
                })
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    Order::from_csv(&csv.join("\r\n")).expect("reference grid parses")
}

/// Cell by cell, with both grids printed on a mismatch.
fn assert_order(got: &Order, want: &Order) {
    assert_eq!(
        got.ranks.len(),
        want.ranks.len(),
        "ranks\n{got}\nwant\n{want}"
    );
    for (r, (g, w)) in got.ranks.iter().zip(&want.ranks).enumerate() {
        assert_eq!(g, w, "rank {r}:\ngot\n{got}\nwant\n{want}");
    }
}

// The reference orders, pp = 2, two stages per rank, m = 4 (A.3).

#[test]
fn looped_bfs_matches_pytorch() {
    let want = grid(&[
        "0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 .   .   2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0",
        ".   1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 1B3 1B2 1B1 1B0",
    ]);
    assert_order(&looped_bfs(4, 2, 2).unwrap(), &want);
}

#[test]
fn interleaved_1f1b_matches_pytorch() {
    let want = grid(&[
        "0F0 0F1 2F0 2F1 .   .   0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 .   2B2 .   2B3 .   0B2 .   0B3",
        ".   1F0 1F1 .   3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 .   1B2 .   1B3",
    ]);
    assert_order(&interleaved_1f1b(4, 2, 2).unwrap(), &want);
}

#[test]
fn interleaved_zero_bubble_matches_pytorch() {
    let want = grid(&[
        "0F0 0F1 2F0 .   2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3",
        ".   1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3",
    ]);
    assert_order(&interleaved_zero_bubble(4, 2, 2).unwrap(), &want);
}

#[test]
fn zbv_matches_pytorch() {
    let want = grid(&[
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
        ".   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3",
    ]);
    assert_order(&zbv(4, 2).unwrap(), &want);
}

#[test]
fn dual_pipe_v_matches_pytorch() {
    let want = grid(&[
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3+3B1 3F2+0B0 3B2 3F3+0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2+1B0 1F3+2B1 2F3+1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    ]);
    let got = dual_pipe_v(4, 2).unwrap();
    assert_order(&got, &want);
    assert_eq!(
        got.ranks[0][7],
        Some(Cell::Overlap(Action::forward(0, 3), Action::backward(3, 1)))
    );
}

/// ZB-H1's rule (see `zb_h1`'s docs), worked by hand for pp = 2, m = 4: rank 0 warms up
/// with one forward and one bubble, then F, I, W per step; rank 1 (the last) starts one
/// step late and holds one W back, which goes last.
#[test]
fn zb_h1_follows_its_rule() {
    let want = grid(&[
        "0F0 .   0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3",
        ".   1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3",
    ]);
    assert_order(&zb_h1(4, 2).unwrap(), &want);
    // It is PyTorch's interleaved zero bubble with one stage per rank where that runs.
    for (m, pp) in [(4, 2), (6, 3), (8, 4), (3, 4), (2, 2)] {
        assert_eq!(
            zb_h1(m, pp).unwrap(),
            interleaved_zero_bubble(m, pp, 1).unwrap()
        );
    }
    // PyTorch refuses m = 5 on pp = 2 (5 % 2 rounds); with one stage per rank we run it.
    assert!(interleaved_zero_bubble(5, 2, 1).is_err());
    zb_h1(5, 2).unwrap().to_schedule().unwrap();
}

/// Every generator's order, over several shapes.
fn all_orders() -> Vec<(String, Order)> {
    let mut out = Vec::new();
    for pp in 1..=4 {
        for m in 1..=9 {
            for per_rank in 1..=3 {
                let tag = |name: &str| format!("{name}(m={m}, pp={pp}, per_rank={per_rank})");
                out.push((tag("looped_bfs"), looped_bfs(m, pp, per_rank).unwrap()));
                if let Ok(o) = interleaved_1f1b(m, pp, per_rank) {
                    out.push((tag("interleaved_1f1b"), o));
                }
                if let Ok(o) = interleaved_zero_bubble(m, pp, per_rank) {
                    out.push((tag("interleaved_zero_bubble"), o));
                }
            }
            let tag = |name: &str| format!("{name}(m={m}, pp={pp})");
            out.push((tag("zbv"), zbv(m, pp).unwrap()));
            out.push((tag("zb_h1"), zb_h1(m, pp).unwrap()));
            if m >= 2 * pp {
                out.push((tag("dual_pipe_v"), dual_pipe_v(m, pp).unwrap()));
            }
        }
    }
    out
}

#[test]
fn every_order_is_a_valid_schedule() {
    for (name, order) in all_orders() {
        let schedule = order
            .to_schedule()
            .unwrap_or_else(|e| panic!("{name}: {e}\n{order}"));
        assert_eq!(schedule.workers().len(), order.ranks.len(), "{name}");
        // The stages sit where the placement says.
        let placement = if name.starts_with("zbv") || name.starts_with("dual_pipe_v") {
            v_placement(order.ranks.len())
        } else {
            let per_rank = schedule.stages() / order.ranks.len();
            loop_placement(order.ranks.len(), per_rank)
        };
        assert_eq!(placement.len(), schedule.stages(), "{name}");
        for (stage, &rank) in placement.iter().enumerate() {
            assert_eq!(
                schedule.worker_of(stage),
                Some(rank),
                "{name}: stage {stage}"
            );
        }
    }
}

#[test]
fn every_order_round_trips_through_csv() {
    for (name, order) in all_orders() {
        let csv = order.to_csv();
        assert_eq!(
            Order::from_csv(&csv).unwrap_or_else(|e| panic!("{name}: {e}")),
            order,
            "{name}:\n{csv}"
        );
    }
}

#[test]
fn csv_is_pytorchs_format() {
    let order = dual_pipe_v(4, 2).unwrap();
    let csv = order.to_csv();
    assert!(csv.starts_with("0F0,0F1,0F2,3F0,3I0,3W0,3F1,(0F3;3B1)OVERLAP_F_B,"));
    assert!(csv.ends_with(",2W3,1W3\r\n"));
    assert_eq!(csv.matches("\r\n").count(), 2);
    let bfs = looped_bfs(4, 2, 2).unwrap().to_csv();
    assert!(
        bfs.starts_with("0F0,0F1,0F2,0F3,2F0,2F1,2F2,2F3,,,2B3,"),
        "{bfs}"
    );
    assert!(bfs.contains("\r\n,1F0,"), "{bfs}");
    // A rank whose only cell is a bubble is quoted, as Python's writer does.
    let lonely = Order {
        ranks: vec![vec![Some(Action::forward(0, 0).into())], vec![None]],
    };
    assert_eq!(lonely.to_csv(), "0F0\r\n\"\"\r\n");
    assert_eq!(Order::from_csv(&lonely.to_csv()).unwrap(), lonely);
}

const ONE_F_ONE_B: &str = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\r\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\r\n";

const ONE_F_ONE_B_COMMS: &str = "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0WAIT_SEND_F0,0F2,0SEND_F2,0RECV_B1,0B1,0WAIT_SEND_F1,0F3,0SEND_F3,0RECV_B2,0B2,0WAIT_SEND_F2,0RECV_B3,0B3,0WAIT_SEND_F3,0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0RESHARD\r\n\
1UNSHARD,1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1RECV_F2,1B1,1SEND_B1,1F2,1RECV_F3,1B2,1SEND_B2,1F3,1B3,1SEND_B3,1REDUCE_GRAD,1WAIT_REDUCE_GRAD,1RESHARD,1WAIT_SEND_B0,1WAIT_SEND_B1,1WAIT_SEND_B2,1WAIT_SEND_B3\r\n";

#[test]
fn pytorchs_csv_examples_load() {
    let compute = Order::from_csv(ONE_F_ONE_B).unwrap();
    assert_eq!(compute.ranks[1][0], None);
    assert_eq!((compute.stages(), compute.micro_batches()), (2, 4));
    assert_eq!(compute.to_csv(), ONE_F_ONE_B);
    let one_f_one_b = Schedule::one_f_one_b(4, 2).unwrap();
    assert_eq!(compute.to_schedule().unwrap(), one_f_one_b);
    // The compute_comms dump drops to the same actions (no bubbles there).
    let comms = Order::from_csv(ONE_F_ONE_B_COMMS).unwrap();
    assert_eq!(comms.workers(), compute.workers());
    assert_eq!(comms.to_schedule().unwrap(), one_f_one_b);
    // `\n` line ends and no final line end read the same.
    let unix = ONE_F_ONE_B.replace("\r\n", "\n");
    assert_eq!(Order::from_csv(unix.trim_end()).unwrap(), compute);
}

#[test]
fn csv_cells_follow_from_str() {
    let order =
        Order::from_csv(" 0F1xyz , 1B0 ,,(0F3;3B1)OVERLAP_F_B,0WAIT_SEND_F1,2I7,2W7\n\n3F0")
            .unwrap();
    assert_eq!(
        order.ranks[0],
        vec![
            Some(Action::forward(0, 1).into()),
            Some(Action::backward(1, 0).into()),
            None,
            Some(Cell::Overlap(Action::forward(0, 3), Action::backward(3, 1))),
            Some(Action::input_grad(2, 7).into()),
            Some(Action::weight_grad(2, 7).into()),
        ]
    );
    assert!(order.ranks[1].is_empty());
    assert_eq!(order.ranks[2], vec![Some(Action::forward(3, 0).into())]);
    assert_eq!((order.stages(), order.micro_batches()), (4, 8));
    assert_eq!(Order::from_csv("").unwrap(), Order::default());
}

#[test]
fn malformed_cells_name_rank_and_cell() {
    let cases = [
        ("0F0,0X1", "rank 0 cell 1 (line 1, column 2)"),
        ("0F0\n0F1,F0", "rank 1 cell 1 (line 2, column 2)"),
        ("0F", "needs a micro-batch"),
        ("0F0\n,,1W", "rank 1 cell 2"),
        ("0B", "needs a micro-batch"),
        ("0I", "needs a micro-batch"),
        ("(0F1;1B0", "invalid action string"),
        ("(0F1;1B0)FOO", "OVERLAP_F_B"),
        ("(0F1)OVERLAP_F_B", "exactly two"),
        ("(0F1;0SEND_F1)OVERLAP_F_B", "compute actions only"),
        ("99999999999999999999999F0", "too large"),
        ("0F99999999999999999999999", "too large"),
        ("x", "invalid action string"),
        ("0\"F0", "invalid action string"),
        ("\"0F0", "not closed"),
        ("٣F0", "invalid action string"),
    ];
    for (csv, needle) in cases {
        match Order::from_csv(csv) {
            Err(Error::ScheduleName(message)) => {
                assert!(message.contains(needle), "{csv:?}: {message}")
            }
            other => panic!("{csv:?}: {other:?}"),
        }
    }
}

#[test]
fn constraints_are_typed_errors() {
    // Rounds: m % max(1, m / pp) must be 0 (m = 3 on pp = 2 runs, m = 5 does not).
    assert!(interleaved_1f1b(3, 2, 2).is_ok());
    assert!(matches!(
        interleaved_1f1b(5, 2, 2),
        Err(Error::ScheduleName(_))
    ));
    assert!(matches!(
        interleaved_zero_bubble(5, 2, 2),
        Err(Error::ScheduleName(_))
    ));
    assert!(interleaved_1f1b(10, 4, 2).is_ok());
    // DualPipeV needs m >= 2pp.
    assert!(matches!(dual_pipe_v(3, 2), Err(Error::ScheduleName(_))));
    assert!(dual_pipe_v(4, 2).is_ok());
    // ZBV and DualPipeV take no stage count: two per rank is all they can be asked for.
    assert_eq!(zbv(4, 3).unwrap().stages(), 6);
    assert_eq!(dual_pipe_v(6, 3).unwrap().stages(), 6);
    // Nothing to schedule.
    for result in [
        looped_bfs(0, 2, 2),
        looped_bfs(4, 0, 2),
        interleaved_1f1b(4, 2, 0),
        interleaved_zero_bubble(0, 2, 2),
        zbv(0, 2),
        dual_pipe_v(4, 0),
        zb_h1(0, 2),
    ] {
        assert!(
            matches!(result, Err(Error::ScheduleEmpty { .. })),
            "{result:?}"
        );
    }
    assert!(matches!(
        Order::default().to_schedule(),
        Err(Error::ScheduleEmpty { .. })
    ));
}

#[test]
fn zbv_with_few_micro_batches_blanks_the_extra_ones() {
    // PyTorch schedules max(2pp - 1, m) micro-batches and blanks those >= m.
    let order = zbv(1, 2).unwrap();
    assert_eq!(order.micro_batches(), 1);
    order.to_schedule().unwrap();
}

#[test]
fn placements() {
    assert_eq!(loop_placement(2, 2), vec![0, 1, 0, 1]);
    assert_eq!(loop_placement(3, 1), vec![0, 1, 2]);
    assert_eq!(v_placement(2), vec![0, 1, 1, 0]);
    assert_eq!(v_placement(3), vec![0, 1, 2, 2, 1, 0]);
}

#[test]
fn display_is_pytorchs_grid() {
    let order = looped_bfs(1, 2, 1).unwrap();
    let want = [
        "        Rank 0 Rank 1\n".to_string(),
        format!("Step 0: {:<6} {:<6}\n", "0F0", ""),
        format!("Step 1: {:<6} {:<6}\n", "", "1F0"),
        format!("Step 2: {:<6} {:<6}\n", "", "1B0"),
        format!("Step 3: {:<6} {:<6}\n", "0B0", ""),
    ]
    .concat();
    assert_eq!(order.to_string(), want);
    let marked = order.format_marked(2);
    assert!(marked.contains("1B0    <-- ERROR HERE\n"), "{marked}");
    // Overlaps print as PyTorch's compound action; widths follow the widest cell.
    let dual = dual_pipe_v(4, 2).unwrap().to_string();
    assert!(
        dual.contains("Step 07: (0F3;3B1)OVERLAP_F_B (1F3;2B1)OVERLAP_F_B\n"),
        "{dual}"
    );
}

#[test]
fn huge_indices_are_errors_not_allocations() {
    for csv in [
        "18446744073709551615F0",
        "0F18446744073709551615",
        "0F0,1000000000000F0,0B0",
    ] {
        let order = Order::from_csv(csv).unwrap();
        assert!(
            matches!(order.to_schedule(), Err(Error::MissingAction { .. })),
            "{csv}"
        );
    }
}
