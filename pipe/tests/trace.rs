//! Chrome trace export of a recorded step and of a simulation: well-formed JSON, one
//! complete event per span, flows for the messages between workers.

use std::collections::BTreeMap;

use pipe::cpu::{CpuTensor, Linear, ReLU};
use pipe::simulate::{simulate, Costs};
use pipe::trace::{chrome_trace, chrome_trace_of};
use pipe::{Action, Batch, Checkpoint, Layer, Pipe, Record, Schedule, ScheduleKind, SpanKind};

/// Just enough JSON to check the export: a strict recursive-descent parser.
#[derive(Debug, Clone, PartialEq)]
enum Json {
    Null,
    Bool(bool),
    Number(f64),
    String(String),
    Array(Vec<Json>),
    Object(BTreeMap<String, Json>),
}

impl Json {
    fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(map) => map.get(key),
            _ => None,
        }
    }
    fn str(&self, key: &str) -> Option<&str> {
        match self.get(key) {
            Some(Json::String(s)) => Some(s),
            _ => None,
        }
    }
    fn num(&self, key: &str) -> Option<f64> {
        match self.get(key) {
            Some(Json::Number(x)) => Some(*x),
            _ => None,
        }
    }
}

struct Parser<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Parser<'_> {
    fn parse(text: &str) -> Result<Json, String> {
        let mut p = Parser {
            bytes: text.as_bytes(),
            at: 0,
        };
        let value = p.value()?;
        p.space();
        if p.at != p.bytes.len() {
            return Err(format!("trailing input at {}", p.at));
        }
        Ok(value)
    }

    fn space(&mut self) {
        while self.at < self.bytes.len() && b" \t\r\n".contains(&self.bytes[self.at]) {
            self.at += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Result<(), String> {
        self.space();
        if self.bytes.get(self.at) == Some(&c) {
            self.at += 1;
            Ok(())
        } else {
            Err(format!("expected {:?} at {}", c as char, self.at))
        }
    }

    fn value(&mut self) -> Result<Json, String> {
        self.space();
        match self.bytes.get(self.at) {
            Some(b'{') => {
                self.at += 1;
                let mut map = BTreeMap::new();
                self.space();
                if self.bytes.get(self.at) == Some(&b'}') {
                    self.at += 1;
                    return Ok(Json::Object(map));
                }
                loop {
                    self.space();
                    let key = self.string()?;
                    self.eat(b':')?;
                    let value = self.value()?;
                    if map.insert(key.clone(), value).is_some() {
                        return Err(format!("duplicate key {key:?}"));
                    }
                    self.space();
                    match self.bytes.get(self.at) {
                        Some(b',') => self.at += 1,
                        Some(b'}') => {
                            self.at += 1;
                            return Ok(Json::Object(map));
                        }
                        _ => return Err(format!("bad object at {}", self.at)),
                    }
                }
            }
            Some(b'[') => {
                self.at += 1;
                let mut items = Vec::new();
                self.space();
                if self.bytes.get(self.at) == Some(&b']') {
                    self.at += 1;
                    return Ok(Json::Array(items));
                }
                loop {
                    items.push(self.value()?);
                    self.space();
                    match self.bytes.get(self.at) {
                        Some(b',') => self.at += 1,
                        Some(b']') => {
                            self.at += 1;
                            return Ok(Json::Array(items));
                        }
                        _ => return Err(format!("bad array at {}", self.at)),
                    }
                }
            }
            Some(b'"') => self.string().map(Json::String),
            Some(b't') => self.word("true", Json::Bool(true)),
            Some(b'f') => self.word("false", Json::Bool(false)),
            Some(b'n') => self.word("null", Json::Null),
            Some(_) => self.number(),
            None => Err("unexpected end".into()),
        }
    }

    fn word(&mut self, w: &str, v: Json) -> Result<Json, String> {
        if self.bytes[self.at..].starts_with(w.as_bytes()) {
            self.at += w.len();
            Ok(v)
        } else {
            Err(format!("bad literal at {}", self.at))
        }
    }

    fn number(&mut self) -> Result<Json, String> {
        let start = self.at;
        while self.at < self.bytes.len() && b"+-.eE0123456789".contains(&self.bytes[self.at]) {
            self.at += 1;
        }
        let text = std::str::from_utf8(&self.bytes[start..self.at]).map_err(|e| e.to_string())?;
        let ok = !text.is_empty()
            && !text.starts_with('+')
            && !text.starts_with('.')
            && !text.ends_with('.');
        match text.parse::<f64>() {
            Ok(x) if ok && x.is_finite() => Ok(Json::Number(x)),
            _ => Err(format!("bad number {text:?} at {start}")),
        }
    }

    fn string(&mut self) -> Result<String, String> {
        if self.bytes.get(self.at) != Some(&b'"') {
            return Err(format!("expected a string at {}", self.at));
        }
        self.at += 1;
        let mut out = Vec::new();
        loop {
            match self.bytes.get(self.at) {
                None => return Err("unterminated string".into()),
                Some(b'"') => {
                    self.at += 1;
                    return String::from_utf8(out).map_err(|e| e.to_string());
                }
                Some(b'\\') => {
                    let c = *self.bytes.get(self.at + 1).ok_or("bad escape")?;
                    self.at += 2;
                    match c {
                        b'"' | b'\\' | b'/' => out.push(c),
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        b'b' => out.push(8),
                        b'f' => out.push(12),
                        b'u' => {
                            let hex = self.bytes.get(self.at..self.at + 4).ok_or("bad \\u")?;
                            let code = u32::from_str_radix(
                                std::str::from_utf8(hex).map_err(|e| e.to_string())?,
                                16,
                            )
                            .map_err(|e| e.to_string())?;
                            let c = char::from_u32(code).ok_or("bad code point")?;
                            out.extend(c.to_string().as_bytes());
                            self.at += 4;
                        }
                        _ => return Err(format!("bad escape at {}", self.at)),
                    }
                }
                Some(&c) if c < 0x20 => return Err("control character in a string".into()),
                Some(&c) => {
                    out.push(c);
                    self.at += 1;
                }
            }
        }
    }
}

fn events(trace: &str) -> Vec<Json> {
    let json = Parser::parse(trace).unwrap_or_else(|e| panic!("{e}\n{trace}"));
    match json.get("traceEvents") {
        Some(Json::Array(events)) => events.clone(),
        other => panic!("no traceEvents array: {other:?}"),
    }
}

fn of_phase<'a>(events: &'a [Json], ph: &str) -> Vec<&'a Json> {
    events.iter().filter(|e| e.str("ph") == Some(ph)).collect()
}

/// Checks the flows pair up (one `s` and one `f` per id, `f` not before `s`) and returns
/// their number.
fn flows(events: &[Json]) -> usize {
    let starts = of_phase(events, "s");
    let finishes = of_phase(events, "f");
    assert_eq!(starts.len(), finishes.len());
    for s in &starts {
        let id = s.num("id").unwrap();
        let f: Vec<_> = finishes
            .iter()
            .filter(|f| f.num("id") == Some(id))
            .collect();
        assert_eq!(f.len(), 1, "flow {id}");
        assert!(f[0].num("ts").unwrap() >= s.num("ts").unwrap());
        assert_ne!(f[0].num("tid"), s.num("tid"), "a flow crosses workers");
        for e in [s, f[0]] {
            for key in ["ts", "pid", "tid"] {
                assert!(e.num(key).is_some(), "{key} in {e:?}");
            }
        }
    }
    starts.len()
}

fn model() -> Vec<Box<dyn Layer<CpuTensor>>> {
    vec![
        Box::new(Linear::new(6, 16, 1)),
        Box::new(ReLU),
        Box::new(Linear::new(16, 16, 2)),
        Box::new(Linear::new(16, 3, 3)),
    ]
}

fn recorded_step(kind: ScheduleKind, checkpoint: Checkpoint, m: usize) -> Record {
    recorded(&[2, 2], kind, checkpoint, m, false)
}

fn recorded(
    balance: &[usize],
    kind: ScheduleKind,
    checkpoint: Checkpoint,
    m: usize,
    defer: bool,
) -> Record {
    let mut pipe = Pipe::builder(model(), balance)
        .chunks(m)
        .checkpoint(checkpoint)
        .schedule(kind)
        .defer_weight_grads(defer)
        .record(true)
        .build()
        .unwrap();
    let x = CpuTensor::from_shape_vec(&[2 * m, 6], (0..12 * m).map(|v| v as f32 / 50.0).collect())
        .unwrap();
    pipe.step(Batch::single(x), |_mb, out| {
        let y = out.tensor(0)?;
        Ok((y.array().sum(), Batch::single(CpuTensor::ones(y.shape()))))
    })
    .unwrap();
    pipe.take_record().unwrap()
}

#[test]
fn a_recorded_step_exports_one_event_per_span_and_a_flow_per_message() {
    const M: usize = 4;
    for (kind, checkpoint) in [
        (ScheduleKind::GPipe, Checkpoint::ExceptLast),
        (ScheduleKind::OneFOneB, Checkpoint::Never),
    ] {
        let record = recorded_step(kind, checkpoint, M);
        let trace = chrome_trace(&record, None);
        let events = events(&trace);
        let slices = of_phase(&events, "X");
        let spans: usize = record.workers().iter().map(Vec::len).sum();
        assert_eq!(slices.len(), spans, "{kind}");
        for e in &slices {
            for key in ["ts", "dur", "pid", "tid"] {
                assert!(e.num(key).is_some(), "{key} in {e:?}");
            }
            assert!(e.num("dur").unwrap() >= 0.0);
            assert_eq!(e.num("pid"), Some(0.0));
            let name = e.str("name").unwrap();
            assert!(name.starts_with("PP:"), "{name}");
            let args = e.get("args").unwrap();
            assert!(args.num("stage").is_some() && args.num("micro_batch").is_some());
        }
        let names: Vec<&str> = slices.iter().map(|e| e.str("name").unwrap()).collect();
        assert!(names.contains(&"PP:1F3"), "{names:?}");
        assert!(names.contains(&"PP:0B0"), "{names:?}");
        assert!(names.contains(&"PP:1F3 loss"), "{names:?}");
        let recomputes = record
            .workers()
            .iter()
            .flatten()
            .filter(|s| s.kind == SpanKind::Recompute)
            .count();
        assert_eq!(
            names.iter().filter(|n| n.ends_with(" recompute")).count(),
            recomputes
        );
        if checkpoint == Checkpoint::ExceptLast {
            assert!(names.contains(&"PP:0F0 recompute"), "{names:?}");
        }
        // One stage boundary: M activations forward, M gradients back.
        assert_eq!(flows(&events), 2 * M, "{kind}");
        // Worker names as metadata.
        assert_eq!(of_phase(&events, "M").len(), 2);

        // With ranks, each worker's events carry its rank as pid.
        let events = self::events(&chrome_trace(&record, Some(&[3, 5])));
        for e in of_phase(&events, "X") {
            let expected = if e.num("tid") == Some(0.0) { 3.0 } else { 5.0 };
            assert_eq!(e.num("pid"), Some(expected));
        }
    }
}

#[test]
fn a_simulation_exports_one_event_per_action() {
    for (m, n) in [(1, 2), (4, 2), (6, 4)] {
        for schedule in [
            Schedule::gpipe(m, n).unwrap(),
            Schedule::one_f_one_b(m, n).unwrap(),
        ] {
            let sim =
                simulate(&schedule, &Costs::uniform(n, 0.001, 0.002, 0.0001).unwrap()).unwrap();
            let events = events(&chrome_trace_of(&sim, &schedule).unwrap());
            let slices = of_phase(&events, "X");
            assert_eq!(slices.len(), 2 * m * n);
            // F of (0, 0) starts at 0, lasts 1 ms = 1000 µs.
            let f00 = slices
                .iter()
                .find(|e| e.str("name") == Some("PP:0F0"))
                .unwrap();
            assert_eq!(f00.num("ts"), Some(0.0));
            assert_eq!(f00.num("dur"), Some(1000.0));
            assert_eq!(flows(&events), 2 * m * (n - 1));
        }
    }
    // Split backwards: the gradient flows from each I, W sends nothing.
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
    let sim = simulate(&schedule, &Costs::uniform(2, 1.0, 2.0, 0.0).unwrap()).unwrap();
    let events = events(&chrome_trace_of(&sim, &schedule).unwrap());
    let names: Vec<&str> = of_phase(&events, "X")
        .iter()
        .map(|e| e.str("name").unwrap())
        .collect();
    assert!(
        names.contains(&"PP:1I0") && names.contains(&"PP:0W1"),
        "{names:?}"
    );
    assert_eq!(flows(&events), 4);
    // A simulation of another schedule is refused.
    let sim = simulate(
        &Schedule::gpipe(2, 2).unwrap(),
        &Costs::uniform(2, 1.0, 1.0, 0.0).unwrap(),
    )
    .unwrap();
    assert!(chrome_trace_of(&sim, &Schedule::one_f_one_b(2, 2).unwrap()).is_err());
}

#[test]
fn three_stages_and_deferred_weight_gradients() {
    const M: usize = 3;
    let record = recorded(
        &[1, 2, 1],
        ScheduleKind::OneFOneB,
        Checkpoint::Always,
        M,
        true,
    );
    let events = events(&chrome_trace(&record, None));
    let slices = of_phase(&events, "X");
    let spans: usize = record.workers().iter().map(Vec::len).sum();
    assert_eq!(slices.len(), spans);
    let names: Vec<&str> = slices.iter().map(|e| e.str("name").unwrap()).collect();
    for s in 0..3 {
        let flush = format!("PP:{s}W flush");
        assert_eq!(
            names.iter().filter(|n| **n == flush).count(),
            1,
            "{names:?}"
        );
    }
    // Two stage boundaries, each M activations and M gradients.
    assert_eq!(flows(&events), 2 * 2 * M);
    // The flush counts toward the backward it follows.
    let schedule = ScheduleKind::OneFOneB.generate(M, 3).unwrap();
    let costs = Costs::from_record(&record, &schedule).unwrap();
    assert!(costs.stages().iter().all(|c| c.backward.unwrap() > 0.0));
    assert!(costs.stages().iter().all(|c| c.weight_grad.is_none()));
}
