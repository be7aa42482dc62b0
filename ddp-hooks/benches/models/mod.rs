//! Parameter shapes of the benchmark models, in forward order, from their published
//! architectures.

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

/// Number of parameters.
pub fn params(shapes: &[Vec<usize>]) -> usize {
    shapes.iter().map(|s| s.iter().product::<usize>()).sum()
}
