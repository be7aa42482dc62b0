//! Constructor validation and container semantics (§7 rows 3-5 and 15): torchgpipe's
//! messages, with the bad value appended.

mod common;

use std::time::Duration;

use common::*;
use pipe::cpu::{CpuTensor, ReLU};
use pipe::{Batch, Checkpoint, Device, Error, Layer, Pipe};

fn relus(n: usize) -> Vec<Box<dyn Layer<CpuTensor>>> {
    (0..n)
        .map(|_| Box::new(ReLU) as Box<dyn Layer<CpuTensor>>)
        .collect()
}

fn build_err(layers: usize, balance: &[usize]) -> Error {
    match Pipe::builder(relus(layers), balance).build() {
        Ok(_) => panic!("balance {balance:?} for {layers} layers was accepted"),
        Err(e) => e,
    }
}

#[test]
fn balance_of_the_wrong_length() {
    assert_eq!(
        build_err(3, &[1, 1]).to_string(),
        "layers and sum of balance have different length (layers: 3, sum of balance: 2)"
    );
    assert!(matches!(
        build_err(1, &[1, 1]),
        Error::BalanceLength { layers: 1, sum: 2 }
    ));
}

#[test]
fn balance_less_than_1() {
    assert_eq!(
        build_err(2, &[0, 2]).to_string(),
        "all balance numbers must be positive integer (balance: [0, 2])"
    );
}

#[test]
fn too_few_devices_and_extra_devices_dropped() {
    let err = Pipe::builder(relus(4), &[1, 1, 1, 1])
        .devices(vec![Device::Cpu; 3])
        .build()
        .err();
    assert_eq!(
        err.map(|e| e.to_string()).as_deref(),
        Some("too few devices to hold given partitions (devices: 3, partitions: 4)")
    );
    let pipe = Pipe::builder(relus(3), &[2, 1])
        .devices(Device::cores(4))
        .build()
        .unwrap();
    assert_eq!(pipe.devices(), &[Device::CpuCore(0), Device::CpuCore(1)]);
}

#[test]
fn chunks_less_than_1_and_checkpoint_mode_invalid() {
    let err = Pipe::builder(relus(1), &[1])
        .chunks(0)
        .build()
        .err()
        .unwrap();
    assert_eq!(
        err.to_string(),
        "number of chunks must be positive integer (got 0)"
    );
    let err = "sometimes".parse::<Checkpoint>().unwrap_err();
    assert_eq!(
        err.to_string(),
        "checkpoint is not one of 'always', 'except_last', or 'never' (got \"sometimes\")"
    );
    for mode in ["always", "except_last", "never"] {
        assert_eq!(mode.parse::<Checkpoint>().unwrap().to_string(), mode);
    }
    let err = Pipe::builder(relus(1), &[1])
        .timeout(Duration::ZERO)
        .build()
        .err()
        .unwrap();
    assert!(matches!(err, Error::ZeroTimeout));
}

#[test]
fn sequential_like_partitions_keep_layer_order() {
    let log = new_log();
    let layers: Vec<Box<dyn Layer<CpuTensor>>> = (0..5)
        .map(|t| Box::new(Probe::new(t, &log)) as Box<dyn Layer<CpuTensor>>)
        .collect();
    let mut pipe = Pipe::builder(layers, &[2, 3]).build().unwrap();
    assert_eq!(pipe.balance(), vec![2, 3]);
    assert_eq!(pipe.partitions()[1].len(), 3);
    pipe.eval();
    pipe.forward(Batch::single(data(1, 2, 1))).unwrap();
    let order: Vec<usize> = events(&log).iter().map(|e| e.tag).collect();
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
    assert_eq!(pipe.into_layers().len(), 5);
}

#[test]
fn empty_pipe_returns_its_input() {
    // test_empty_module: no layers, balance [], forward is the identity.
    let mut pipe = Pipe::<CpuTensor>::builder(Vec::new(), &[])
        .chunks(3)
        .build()
        .unwrap();
    let x = data(5, 2, 1);
    assert_eq!(
        pipe.forward(Batch::single(x.clone())).unwrap(),
        Batch::single(x.clone())
    );
    assert_eq!(
        pipe.backward(Batch::single(x.clone())).unwrap(),
        Batch::single(x.clone())
    );
    let step = pipe.step(Batch::single(x.clone()), sum_loss).unwrap();
    assert_eq!(step.losses.len(), 3);
    assert_eq!(step.output, Batch::single(x.clone()));
    assert_eq!(step.input_grad, Batch::single(CpuTensor::ones(&[5, 2])));
}

#[test]
fn a_device_the_tensor_cannot_use_is_an_error() {
    let mut pipe = Pipe::builder(relus(2), &[1, 1])
        .devices(vec![Device::Cpu, Device::Cuda(0)])
        .build()
        .unwrap();
    let err = pipe.forward(Batch::single(data(2, 2, 1))).unwrap_err();
    assert_eq!(
        err.to_string(),
        "partition 0, micro-batch 0, forward: CpuTensor cannot move to cuda:0"
    );
}

#[test]
fn pinned_workers_run_on_their_cores() {
    // Best effort on non-Linux; on Linux core 0 always exists.
    let mut pipe = Pipe::builder(relus(2), &[1, 1])
        .devices(vec![Device::CpuCore(0); 2])
        .build()
        .unwrap();
    pipe.forward(Batch::single(data(2, 2, 1))).unwrap();
    if cfg!(target_os = "linux") {
        let mut pipe = Pipe::builder(relus(1), &[1])
            .devices(vec![Device::CpuCore(100_000)])
            .build()
            .unwrap();
        assert!(matches!(
            pipe.forward(Batch::single(data(2, 2, 1))),
            Err(Error::Pin { core: 100_000, .. })
        ));
    }
}
