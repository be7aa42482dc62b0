//! The `Accumulator`'s sync pattern, loss scales and gates, and the guards' restoration.

use accum::{no_sync, with_no_sync, Accumulator, Config, Error, GradSync, Step};

/// A sync flag that records every change, standing in for an engine's switch.
#[derive(Debug)]
struct Flag {
    on: bool,
    changes: usize,
    accumulating: bool,
}

impl Flag {
    fn new(on: bool) -> Self {
        Flag {
            on,
            changes: 0,
            accumulating: false,
        }
    }
}

impl GradSync for Flag {
    fn set_sync(&mut self, on: bool) -> bool {
        self.changes += 1;
        std::mem::replace(&mut self.on, on)
    }
    fn sync_enabled(&self) -> bool {
        self.on
    }
    fn set_accumulating(&mut self, on: bool) -> bool {
        std::mem::replace(&mut self.accumulating, on)
    }
}

/// Accelerate's `accumulate` enters `no_sync` on the steps that do not communicate and
/// nothing on the others: inside an outer `no_sync`, a communicating step leaves sync
/// off. Each step also tells the target whether the group goes on after it, and the
/// guard restores both settings.
#[test]
fn a_step_inside_no_sync_stays_unsynchronised_and_says_whether_the_group_goes_on() {
    for sync_each_batch in [false, true] {
        let mut f = Flag::new(true);
        let mut acc = Accumulator::with_config(Config {
            num_steps: 2,
            sync_each_batch,
            sync_at_end_of_data: true,
        })
        .unwrap();
        acc.start_epoch(4);
        for i in 0..4 {
            let step = acc.next_step().unwrap();
            {
                let mut outer = no_sync(&mut f);
                let inner = step.apply(&mut *outer);
                assert!(!inner.sync_enabled(), "step {i}: the outer no_sync holds");
                assert_eq!(inner.accumulating, i % 2 == 0, "step {i}");
            }
            assert!(f.on && !f.accumulating, "step {i}: both restored");
            {
                let inner = step.apply(&mut f);
                assert_eq!(inner.sync_enabled(), step.communicates(), "step {i}");
                assert_eq!(inner.accumulating, !step.sync_gradients(), "step {i}");
            }
            assert!(f.on && !f.accumulating, "step {i}: both restored");
        }
    }
}

/// The expected pattern, simulated from the definition: a step closes its group when it
/// is the n-th since the last close, or (with end-of-data sync) the last of its epoch; a
/// group's size is its number of steps (with end-of-data sync; otherwise always n).
fn expected(n: usize, epochs: &[usize], end_sync: bool) -> Vec<(bool, usize)> {
    let mut closes = Vec::new();
    let mut since = 0;
    for &len in epochs {
        for i in 0..len {
            since += 1;
            let c = since == n || (end_sync && i + 1 == len);
            if c {
                since = 0;
            }
            closes.push(c);
        }
    }
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &c) in closes.iter().enumerate() {
        if c || i + 1 == closes.len() {
            let size = if end_sync { i + 1 - start } else { n };
            out.extend(closes[start..=i].iter().map(|&c| (c, size)));
            start = i + 1;
        }
    }
    out
}

#[test]
fn sync_pattern_and_loss_scale() {
    for n in 1..=3 {
        for end_sync in [true, false] {
            for sync_each_batch in [false, true] {
                let epochs = [1, 2, 3, 4, 5, 6, 7, 7];
                let mut acc = Accumulator::with_config(Config {
                    num_steps: n,
                    sync_each_batch,
                    sync_at_end_of_data: end_sync,
                })
                .unwrap();
                let mut got = Vec::new();
                for &len in &epochs {
                    for (step, _) in acc.epoch(0..len) {
                        assert_eq!(
                            step.communicates(),
                            step.sync_gradients() || sync_each_batch
                        );
                        assert_eq!(step.loss_scale(), 1.0 / step.group_size() as f32);
                        got.push((step.sync_gradients(), step.group_size()));
                    }
                }
                assert_eq!(
                    got,
                    expected(n, &epochs, end_sync),
                    "n={n} end_sync={end_sync}"
                );
            }
        }
    }
}

#[test]
fn loss_scales_of_each_group_sum_to_one() {
    // 10 batches in groups of 4: 4 + 4 + 2; the short group is scaled by 1/2, not 1/4.
    let mut acc = Accumulator::new(4).unwrap();
    let scales: Vec<f32> = acc.epoch(0..10).map(|(s, _)| s.loss_scale()).collect();
    assert_eq!(
        scales,
        [0.25; 8]
            .iter()
            .chain(&[0.5, 0.5])
            .copied()
            .collect::<Vec<_>>()
    );
    let syncs: Vec<usize> = acc
        .epoch(0..10)
        .filter(|(s, _)| s.sync_gradients())
        .map(|(_, i)| i)
        .collect();
    assert_eq!(syncs, [3, 7, 9]);
}

#[test]
fn gates_act_only_on_sync_steps() {
    let mut acc = Accumulator::new(3).unwrap();
    let (mut opt, mut zero, mut sched) = (0, 0, 0);
    for (step, _) in acc.epoch(0..8) {
        step.optimizer_step(|| opt += 1);
        step.zero_grad(|| zero += 1);
        step.scheduler_step(|| sched += 1);
        assert_eq!(step.on_sync(|| 7), step.sync_gradients().then_some(7));
    }
    assert_eq!((opt, zero, sched), (3, 3, 3)); // groups of 3, 3, 2
}

#[test]
fn apply_switches_sync_per_step_and_restores() {
    let mut engine = Flag::new(true);
    let mut acc = Accumulator::new(2).unwrap();
    let mut seen = Vec::new();
    for (step, _) in acc.epoch(0..5) {
        let model = step.apply(&mut engine);
        seen.push(model.sync_enabled());
    }
    assert_eq!(seen, [false, true, false, true, true]);
    assert!(engine.on, "the previous setting is restored");
}

#[test]
fn errors_are_values() {
    assert_eq!(Accumulator::new(0).unwrap_err(), Error::InvalidNumSteps(0));
    let mut acc = Accumulator::new(2).unwrap();
    assert_eq!(acc.next_step().unwrap_err(), Error::NoEpoch);
    acc.start_epoch(1);
    assert!(acc.next_step().unwrap().sync_gradients());
    assert_eq!(acc.next_step().unwrap_err(), Error::EpochOver { len: 1 });
    // An empty epoch takes no step.
    assert_eq!(acc.epoch(0..0).count(), 0);
}

#[test]
fn an_iterator_longer_than_its_len_is_cut() {
    /// Claims 2 items, yields 4.
    struct Liar(usize);
    impl Iterator for Liar {
        type Item = usize;
        fn next(&mut self) -> Option<usize> {
            self.0 += 1;
            (self.0 <= 4).then_some(self.0)
        }
    }
    impl ExactSizeIterator for Liar {
        fn len(&self) -> usize {
            2
        }
    }
    let mut acc = Accumulator::new(4).unwrap();
    let steps: Vec<_> = acc.epoch(Liar(0)).collect();
    assert_eq!(steps.len(), 2);
    assert!(steps[1].0.sync_gradients() && steps[1].0.end_of_data());
}

#[test]
fn guards_nest_and_restore_in_order() {
    let mut f = Flag::new(true);
    {
        let mut outer = no_sync(&mut f);
        assert!(!outer.sync_enabled());
        {
            let inner = accum::SyncGuard::new(&mut *outer, true);
            assert!(inner.sync_enabled());
            assert!(!inner.previous());
        }
        assert!(!outer.sync_enabled());
    }
    assert!(f.on);
    assert_eq!(f.changes, 4);
}

#[test]
fn guard_restores_on_early_return() {
    fn fails(f: &mut Flag) -> Result<(), String> {
        let _g = no_sync(f);
        Err("early".to_string())?;
        Ok(())
    }
    let mut f = Flag::new(true);
    assert!(fails(&mut f).is_err());
    assert!(f.on);
    // And a guard under sync-off restores "off".
    let mut g = Flag::new(false);
    with_no_sync(&mut g, |g| assert!(!g.sync_enabled()));
    assert!(!g.on);
}

#[test]
fn guard_restores_on_caught_panic() {
    let mut f = Flag::new(true);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        with_no_sync(&mut f, |f| {
            assert!(!f.sync_enabled());
            panic!("boom");
        })
    }));
    assert!(caught.is_err());
    assert!(f.on, "sync restored while unwinding");
}

/// A stream of unknown length syncs as an epoch of its length would: the look-ahead
/// finds the last batch, which closes its group. Unbounded, every `num_steps`-th step
/// syncs and none is the end of the data.
#[test]
fn a_stream_ends_its_last_group_as_an_epoch_of_its_length_does() {
    for n in 1..=3 {
        for len in 0..8 {
            let mut sized = Accumulator::new(n).unwrap();
            let want: Vec<Step> = sized.epoch(0..len).map(|(s, _)| s).collect();
            let mut streamed = Accumulator::new(n).unwrap();
            let got: Vec<Step> = streamed
                .stream((0..len).filter(|_| true))
                .map(|(s, _)| s)
                .collect();
            assert_eq!(got.len(), want.len(), "n = {n}, len = {len}");
            for (g, w) in got.iter().zip(&want) {
                let what = format!("n = {n}, len = {len}, step {}", w.index());
                assert_eq!(g.sync_gradients(), w.sync_gradients(), "{what}");
                assert_eq!(g.communicates(), w.communicates(), "{what}");
                assert_eq!(g.end_of_data(), w.end_of_data(), "{what}");
                assert_eq!(g.index(), w.index(), "{what}");
                // A stream cannot know its last group is short: Accelerate's scale.
                assert_eq!(g.group_size(), n, "{what}");
            }
        }
        let mut open = Accumulator::new(n).unwrap();
        open.start_unbounded();
        for i in 0..10 {
            let step = open.next_step().unwrap();
            assert_eq!(step.sync_gradients(), (i + 1) % n == 0, "n = {n}, step {i}");
            assert!(!step.end_of_data());
        }
    }
}
