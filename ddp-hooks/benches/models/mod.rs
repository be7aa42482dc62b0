//! Parameter shapes of the benchmark models, in forward order, from their published
//! architectures. Shared by the `hooks` suite and the compression report.

#![allow(dead_code)]

pub mod shapes;

/// 4 x Linear(1024, 1024) with bias: 4.2 M parameters, 16.8 MB of gradients.
pub fn linear4() -> Vec<Vec<usize>> {
    (0..4)
        .flat_map(|_| [vec![1024, 1024], vec![1024]])
        .collect()
}

/// ResNet-50 (He et al. 2016, torchvision layout): convolutions without bias, each
/// followed by a batch norm (weight and bias), bottleneck stages [3, 4, 6, 3], fc.
pub fn resnet50() -> Vec<Vec<usize>> {
    let mut s = vec![vec![64, 3, 7, 7], vec![64], vec![64]];
    let mut inp = 64;
    for (blocks, width) in [(3, 64), (4, 128), (6, 256), (3, 512)] {
        for b in 0..blocks {
            let out = 4 * width;
            for (o, i, k) in [(width, inp, 1), (width, width, 3), (out, width, 1)] {
                s.push(vec![o, i, k, k]);
                s.push(vec![o]);
                s.push(vec![o]);
            }
            if b == 0 {
                s.push(vec![out, inp, 1, 1]);
                s.push(vec![out]);
                s.push(vec![out]);
            }
            inp = out;
        }
    }
    s.push(vec![1000, 2048]);
    s.push(vec![1000]);
    s
}

/// BERT-base (Devlin et al. 2019): embeddings, 12 layers of hidden 768, 12 heads, FFN
/// 3072, pooler.
pub fn bert_base() -> Vec<Vec<usize>> {
    let h = 768;
    let mut s = vec![vec![30522, h], vec![512, h], vec![2, h], vec![h], vec![h]];
    for _ in 0..12 {
        for _ in 0..4 {
            s.push(vec![h, h]);
            s.push(vec![h]);
        }
        s.push(vec![h]);
        s.push(vec![h]);
        s.push(vec![3072, h]);
        s.push(vec![3072]);
        s.push(vec![h, 3072]);
        s.push(vec![h]);
        s.push(vec![h]);
        s.push(vec![h]);
    }
    s.push(vec![h, h]);
    s.push(vec![h]);
    s
}

/// GPT-2 small (Radford et al. 2019, the released 124 M model as Hugging Face lays it
/// out): token embeddings (vocabulary 50257, tied to the output layer, so counted once),
/// position embeddings (1024), 12 blocks of width 768 with 12 heads and MLP 3072, final
/// layer norm. Projections are `Conv1D`s whose weights are stored `in x out`.
pub fn gpt2_small() -> Vec<Vec<usize>> {
    let d = 768;
    let mut s = vec![vec![50257, d], vec![1024, d]];
    for _ in 0..12 {
        s.push(vec![d]); // ln_1
        s.push(vec![d]);
        s.push(vec![d, 3 * d]); // attn.c_attn
        s.push(vec![3 * d]);
        s.push(vec![d, d]); // attn.c_proj
        s.push(vec![d]);
        s.push(vec![d]); // ln_2
        s.push(vec![d]);
        s.push(vec![d, 4 * d]); // mlp.c_fc
        s.push(vec![4 * d]);
        s.push(vec![4 * d, d]); // mlp.c_proj
        s.push(vec![d]);
    }
    s.push(vec![d]); // ln_f
    s.push(vec![d]);
    s
}

/// A preset: its name, its parameter shapes, and whether the hook is called directly on
/// one bucket holding every parameter rather than through the reducer.
pub type Preset = (&'static str, fn() -> Vec<Vec<usize>>, bool);

/// The presets, in report order.
pub fn presets() -> Vec<Preset> {
    vec![
        ("linear4x1024", linear4 as fn() -> Vec<Vec<usize>>, true),
        ("resnet50", resnet50, false),
        ("bert-base", bert_base, false),
        ("gpt2-small", gpt2_small, false),
    ]
}

/// Number of parameters.
pub fn params(shapes: &[Vec<usize>]) -> usize {
    shapes.iter().map(|s| s.iter().product::<usize>()).sum()
}

/// The published parameter counts (torchvision, Hugging Face), checked by the report
/// before it measures anything: a preset that drifts from its model is an error.
pub const PUBLISHED: [(&str, usize); 4] = [
    ("linear4x1024", 4 * (1024 * 1024 + 1024)),
    ("resnet50", 25_557_032),
    ("bert-base", 109_482_240),
    ("gpt2-small", 124_439_808),
];
