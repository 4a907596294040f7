//! Graphs for the page cache's BFS: seeded R-MAT generation (Graph500's a, b, c = .57, .19,
//! .19), CSR form (`u64` row offsets, `u32` column indices: the two arrays the GPU reads
//! through the cache), a CPU BFS as the reference, and the GPU BFS (a kernel per level).

use std::time::Instant;

use anyhow::{Result, ensure};
use gpu_queues::GpuQueues;
use gpu_queues::ffi::{Arg, DeviceMemory};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use zerocopy::IntoBytes;

use super::{Source, grid_for, wait};

/// A vertex's level before BFS reaches it.
pub const UNVISITED: u32 = u32::MAX;

/// A graph in compressed sparse row form: vertex v's neighbours are
/// `cols[offsets[v]..offsets[v + 1]]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Csr {
    /// `vertices + 1` row offsets.
    pub offsets: Vec<u64>,
    /// Column indices (neighbours).
    pub cols: Vec<u32>,
}

impl Csr {
    /// Vertices.
    pub fn vertices(&self) -> u32 {
        (self.offsets.len() - 1) as u32
    }

    /// Bytes of both arrays (what the cache's capacity is a share of).
    pub fn bytes(&self) -> u64 {
        (self.offsets.len() * 8 + self.cols.len() * 4) as u64
    }

    /// Vertex v's degree.
    pub fn degree(&self, v: u32) -> u64 {
        self.offsets[v as usize + 1] - self.offsets[v as usize]
    }
}

/// An undirected R-MAT graph of `2^scale` vertices and `edge_factor * 2^scale` edges (each
/// stored in both directions; self loops and duplicates kept, as Graph500's generator keeps
/// them), its vertex numbers scrambled by a bijection so that high degrees are not clustered
/// at low numbers. The same seed gives the same graph.
pub fn rmat(scale: u32, edge_factor: u32, seed: u64) -> Result<Csr> {
    ensure!((1..=28).contains(&scale), "scale {scale}: 1 to 28");
    ensure!(edge_factor >= 1, "edge factor 0");
    let n = 1u64 << scale;
    let edges = n * edge_factor as u64;
    ensure!(edges * 2 <= u32::MAX as u64 * 4, "too many edges");
    let mask = n - 1;
    let scramble = |v: u64| (v.wrapping_mul(0x9e37_79b9_7f4a_7c15 | 1) ^ (seed & mask)) & mask;
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut pairs: Vec<(u32, u32)> = Vec::with_capacity(edges as usize);
    for _ in 0..edges {
        let (mut u, mut v) = (0u64, 0u64);
        for bit in (0..scale).rev() {
            let r: f64 = rng.random();
            // a = .57, b = .19, c = .19, d = .05.
            let (du, dv) = if r < 0.57 {
                (0, 0)
            } else if r < 0.76 {
                (0, 1)
            } else if r < 0.95 {
                (1, 0)
            } else {
                (1, 1)
            };
            u |= du << bit;
            v |= dv << bit;
        }
        pairs.push((scramble(u) as u32, scramble(v) as u32));
    }
    // Counting sort into CSR, both directions.
    let mut offsets = vec![0u64; n as usize + 1];
    for &(u, v) in &pairs {
        offsets[u as usize + 1] += 1;
        offsets[v as usize + 1] += 1;
    }
    for i in 0..n as usize {
        offsets[i + 1] += offsets[i];
    }
    let mut at: Vec<u64> = offsets[..n as usize].to_vec();
    let mut cols = vec![0u32; offsets[n as usize] as usize];
    for &(u, v) in &pairs {
        cols[at[u as usize] as usize] = v;
        at[u as usize] += 1;
        cols[at[v as usize] as usize] = u;
        at[v as usize] += 1;
    }
    Ok(Csr { offsets, cols })
}

/// A root with neighbours: the first vertex from a seeded position with a degree above zero.
pub fn root(g: &Csr, seed: u64) -> u32 {
    let n = g.vertices();
    let start = (seed % n as u64) as u32;
    (0..n)
        .map(|k| (start + k) % n)
        .find(|&v| g.degree(v) > 0)
        .unwrap_or(start)
}

/// BFS levels from `root` on the CPU (the reference): level of every vertex, [`UNVISITED`]
/// where unreachable.
pub fn cpu_bfs(g: &Csr, root: u32) -> Vec<u32> {
    let mut level = vec![UNVISITED; g.vertices() as usize];
    level[root as usize] = 0;
    let mut frontier = vec![root];
    let mut d = 0;
    while !frontier.is_empty() {
        let mut next = Vec::new();
        for &v in &frontier {
            let (s, e) = (g.offsets[v as usize], g.offsets[v as usize + 1]);
            for &u in &g.cols[s as usize..e as usize] {
                if level[u as usize] == UNVISITED {
                    level[u as usize] = d + 1;
                    next.push(u);
                }
            }
        }
        frontier = next;
        d += 1;
    }
    level
}

/// How a BFS level's vertices are split among the kernel's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BfsSplit {
    /// Block b takes the b-th of the grid's equal runs of vertices.
    Static,
    /// Blocks take runs of this many vertices (rounded up to whole groups of 32) from a shared
    /// counter until none is left: a level ends with its last run, not with the block whose
    /// run held the most work.
    Dynamic(u32),
}

impl Default for BfsSplit {
    /// Dynamic runs of 1024 vertices: four groups of 32 per warp of a 256-thread block, the
    /// best of the run sizes tried (the BFS split runs in `benches/results/history.md`).
    fn default() -> Self {
        Self::Dynamic(1024)
    }
}

/// How a GPU BFS spreads its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BfsOptions {
    /// How a level's vertices are split among blocks.
    pub split: BfsSplit,
    /// `Some(n)`: vertices of more than `n` neighbours are cut into pieces of `n` that the blocks
    /// of a second kernel per level take in turn (a block's warps sharing a piece), instead of
    /// being expanded by the one warp that found them. `None`: every vertex by the warp that
    /// found it.
    pub hub_segment: Option<u32>,
    /// With the dynamic split, odd levels hand out their runs from the last vertex down, so that
    /// each level starts on the column pages the level before left in the cache (a clock cache
    /// smaller than one sweep keeps the sweep's tail, which a next sweep the same way evicts
    /// before it reaches it). `false`: every level sweeps up.
    pub alternate: bool,
    /// Which way the levels run.
    pub direction: BfsDirection,
}

/// Which way a GPU BFS's levels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BfsDirection {
    /// Every level expands its frontier's neighbour lists.
    TopDown,
    /// Beamer's direction-optimising BFS: a level runs bottom-up (every unvisited vertex with
    /// neighbours looks for one in the frontier, stopping at the first) when fewer such vertices
    /// are left than the frontier holds, else top-down. Before the first bottom-up level tells
    /// how many unvisited vertices have neighbours, every unvisited vertex counts.
    Optimizing,
}

impl BfsDirection {
    /// Name for reports and the example's `--direction`.
    pub fn name(self) -> &'static str {
        match self {
            Self::TopDown => "top-down",
            Self::Optimizing => "optimizing",
        }
    }
}

impl Default for BfsOptions {
    fn default() -> Self {
        Self {
            split: BfsSplit::default(),
            // Hub vertices' edges in segments of 16384: the best at a cache of a quarter of the
            // graph; smaller caches do better with smaller segments (gpu_bfs --hub-segment; the
            // runs in benches/results/history.md).
            hub_segment: Some(16384),
            alternate: true,
            // Direction-optimizing: the wide middle levels bottom-up read less and finish sooner
            // (the runs in benches/results/history.md).
            direction: BfsDirection::Optimizing,
        }
    }
}

/// Entries of the heavy list (16 bytes each): with pieces of 2048 neighbours, room for the hubs
/// of a graph of 2^27 edges at once (2^30 with the default 16384). A level whose hubs need more
/// expands the rest where found.
const HEAVY_ENTRIES: usize = 1 << 17;

/// The outcome of a GPU BFS.
#[derive(Clone, Debug)]
pub struct BfsRun {
    /// Every vertex's level.
    pub levels: Vec<u32>,
    /// Kernels launched (the last one finds no vertex to visit).
    pub depth: u32,
    /// Seconds of the level kernels, from the first launch to the last kernel's end.
    pub secs: f64,
    /// Seconds of each level, launch to end (host-timed, so each includes a launch).
    pub level_secs: Vec<f64>,
    /// Pieces of hubs' neighbour lists the second kernel expanded, all levels.
    pub hub_pieces: u64,
    /// Which levels ran bottom-up.
    pub bottom_up: Vec<bool>,
    /// Vertices reached.
    pub reached: u64,
}

/// BFS from `root` over a graph of `vertices` vertices read from `src` (array 0: the row
/// offsets, array 1: the columns): one `gpunvme_cache_bfs_level` kernel per level on the
/// queues' client stream (vertex-centric: every level scans the level array in GPU memory and
/// expands the vertices at that level, each block runs of consecutive vertices split as
/// `opts.split` says), then, with `opts.hub_segment`, `gpunvme_cache_bfs_heavy` over the level's
/// high-degree vertices, until a level visits nothing. With [`BfsDirection::Optimizing`] a
/// level with fewer unvisited vertices than frontier vertices runs `gpunvme_cache_bfs_up`
/// instead (bottom-up). Fails if any load failed (a fill's
/// status, a corrupt row).
pub fn gpu_bfs(
    q: &GpuQueues,
    src: Source<'_>,
    vertices: u32,
    root: u32,
    opts: BfsOptions,
) -> Result<BfsRun> {
    ensure!(root < vertices, "root {root} of {vertices} vertices");
    let chunk = match opts.split {
        BfsSplit::Static => 0,
        BfsSplit::Dynamic(n) => {
            ensure!(n > 0, "a dynamic BFS split of 0 vertices");
            n
        }
    };
    let cuda = q.cuda();
    // The BFS kernels are the tools' (loaded at the first use, before anything is timed).
    let tools = q.kernels().tools()?;
    let n = vertices as usize;
    let mut levels = vec![UNVISITED; n];
    levels[root as usize] = 0;
    let lv = DeviceMemory::alloc(cuda, n * 4)?;
    lv.write(0, levels.as_bytes())?;
    // Word 0: vertices the level visited; word 1: failed loads; word 2: the dynamic split's
    // next vertex; word 3: vertices with neighbours a bottom-up level left unvisited.
    let counters = DeviceMemory::alloc(cuda, 32)?;
    ensure!(
        opts.hub_segment != Some(0),
        "a BFS hub segment of 0 neighbours"
    );
    let segment = opts.hub_segment.unwrap_or(0);
    // The heavy list: entries taken, capacity, then (begin, end) pairs.
    let heavy = if segment > 0 {
        let h = DeviceMemory::alloc(cuda, 16 + HEAVY_ENTRIES * 16)?;
        h.write(0, [0u64, HEAVY_ENTRIES as u64].as_bytes())?;
        Some(h)
    } else {
        None
    };
    let (cache, r_off, p_off) = src.array(0);
    let (_, r_col, p_col) = src.array(1);
    let grid = grid_for(q, vertices as u64);
    let launch = |kernel, args: &[Arg]| q.client_stream().launch(kernel, grid, super::BLOCK, args);
    let mut depth = 0u32;
    let mut level_secs = Vec::new();
    let mut hub_pieces = 0u64;
    let mut bottom_up = Vec::new();
    // The frontier's size, the vertices not yet reached, and (once a bottom-up level counted
    // them) how many of those have neighbours.
    let (mut frontier, mut unreached) = (1u64, vertices as u64 - 1);
    let mut unreached_with_edges: Option<u64> = None;
    let start = Instant::now();
    loop {
        counters.write(0, [0u64; 4].as_bytes())?;
        let up = opts.direction == BfsDirection::Optimizing
            && depth > 0
            && unreached_with_edges.unwrap_or(unreached) < frontier;
        bottom_up.push(up);
        let heavy = heavy.as_ref().filter(|_| !up);
        if let Some(h) = heavy {
            h.write(0, 0u64.as_bytes())?;
        }
        let level_start = Instant::now();
        let reverse = Arg::U32(u32::from(opts.alternate && depth % 2 == 1));
        let common = [
            Arg::U64(cache),
            Arg::U32(r_off),
            Arg::U32(r_col),
            Arg::U64(p_off),
            Arg::U64(p_col),
            Arg::U32(vertices),
            Arg::U64(lv.ptr()),
            Arg::U32(depth),
            Arg::U64(counters.ptr()),
            Arg::U64(counters.ptr() + 8),
            Arg::U64(counters.ptr() + 16),
            Arg::U32(chunk),
        ];
        if up {
            let tail = [reverse, Arg::U64(counters.ptr() + 24)];
            launch(tools.cache_bfs_up, &[&common[..], &tail].concat())?;
        } else {
            let tail = [
                Arg::U64(heavy.map_or(0, |h| h.ptr())),
                Arg::U32(segment),
                reverse,
            ];
            launch(tools.cache_bfs_level, &[&common[..], &tail].concat())?;
        }
        if let Some(h) = heavy {
            // Same stream: it starts when the level kernel has ended and published its list.
            launch(
                tools.cache_bfs_heavy,
                &[
                    Arg::U64(cache),
                    Arg::U32(r_col),
                    Arg::U64(p_col),
                    Arg::U32(vertices),
                    Arg::U64(lv.ptr()),
                    Arg::U32(depth),
                    Arg::U64(counters.ptr()),
                    Arg::U64(counters.ptr() + 8),
                    Arg::U64(h.ptr()),
                ],
            )?;
        }
        wait(q, "a BFS level")?;
        level_secs.push(level_start.elapsed().as_secs_f64());
        if let Some(h) = heavy {
            let mut taken = 0u64;
            h.read(0, taken.as_mut_bytes())?;
            hub_pieces += taken.min(HEAVY_ENTRIES as u64);
        }
        let mut words = [0u64; 4];
        counters.read(0, words.as_mut_bytes())?;
        ensure!(
            words[1] == 0,
            "BFS level {depth}: {} loads failed{}",
            words[1],
            src.failure_detail()
        );
        depth += 1;
        // Every vertex a level reaches has a neighbour (the one it was reached from).
        frontier = words[0];
        unreached = unreached.saturating_sub(words[0]);
        unreached_with_edges = if up {
            Some(words[3])
        } else {
            unreached_with_edges.map(|n| n.saturating_sub(words[0]))
        };
        if words[0] == 0 {
            break;
        }
        ensure!(depth < vertices, "BFS: more levels than vertices");
    }
    let secs = start.elapsed().as_secs_f64();
    lv.read(0, levels.as_mut_bytes())?;
    let reached = levels.iter().filter(|&&l| l != UNVISITED).count() as u64;
    Ok(BfsRun {
        levels,
        depth,
        secs,
        level_secs,
        hub_pieces,
        bottom_up,
        reached,
    })
}

/// The first vertex whose GPU level differs from the CPU's, if any.
pub fn first_mismatch(gpu: &[u32], cpu: &[u32]) -> Option<(usize, u32, u32)> {
    gpu.iter()
        .zip(cpu)
        .enumerate()
        .find(|(_, (g, c))| g != c)
        .map(|(i, (&g, &c))| (i, g, c))
        .or_else(|| (gpu.len() != cpu.len()).then_some((gpu.len().min(cpu.len()), 0, 0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmat_is_seeded_symmetric_and_skewed() {
        let g = rmat(10, 8, 1).unwrap();
        assert_eq!(g, rmat(10, 8, 1).unwrap());
        assert_ne!(g, rmat(10, 8, 2).unwrap());
        assert_eq!(g.vertices(), 1024);
        assert_eq!(g.cols.len(), 2 * 8 * 1024);
        assert!(g.offsets.windows(2).all(|w| w[0] <= w[1]));
        // Every edge is stored both ways.
        let has = |u: u32, v: u32| {
            g.cols[g.offsets[u as usize] as usize..g.offsets[u as usize + 1] as usize].contains(&v)
        };
        for u in (0..1024).step_by(37) {
            for k in g.offsets[u as usize]..g.offsets[u as usize + 1] {
                assert!(has(g.cols[k as usize], u));
            }
        }
        // Power law: the largest degree is far above the mean of 16.
        let max = (0..1024).map(|v| g.degree(v)).max().unwrap();
        assert!(max > 100, "max degree {max}");
    }

    #[test]
    fn cpu_bfs_levels_on_a_path_and_a_star() {
        // 0-1-2-3 and 4 alone.
        let g = Csr {
            offsets: vec![0, 1, 3, 5, 6, 6],
            cols: vec![1, 0, 2, 1, 3, 2],
        };
        assert_eq!(cpu_bfs(&g, 0), [0, 1, 2, 3, UNVISITED]);
        assert_eq!(cpu_bfs(&g, 2), [2, 1, 0, 1, UNVISITED]);
        assert_eq!(root(&g, 4), 0);
        assert_eq!(first_mismatch(&[0, 1], &[0, 2]), Some((1, 1, 2)));
        assert_eq!(first_mismatch(&[0, 1], &[0, 1]), None);
    }
}
