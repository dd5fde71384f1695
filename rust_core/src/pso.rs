//! HOME's particle swarm search (Algorithms 1 and 3).
//!
//! A particle is a plan (one action per unit). Each iteration every particle sweeps its units in
//! order; for unit j it tries the action of the last iteration's best particle (P1) and the
//! action of its own best-ever plan (P2), evaluating each with the evaluator, and keeps the
//! better (P2 on a tie, as in the paper). Two legitimate speed-ups that do not change the result:
//! when P1[j] == P2[j] the choice is forced and nothing is evaluated, and a candidate equal to the
//! particle's current plan reuses its known score; and a particle whose last sweep left it where
//! it was, with the same P1 and P2 as then, is at a fixed point of the sweep and is not swept
//! again (the sweep is deterministic). Particles are updated in parallel (rayon); all
//! randomness comes from per-particle generators derived from the seed, so the result does not
//! depend on the thread count.
//!
//! Extensions after the swarm (`PsoSettings`): the polish of its best plans (crate::polish),
//! restarts (smaller swarms from random plans, each best polished) and path relinking between
//! the polished plans (crate::relink). Each only adds candidates, so none makes the result worse.

use crate::action::Action;
use crate::error::{CoreError, Result};
use crate::evaluator::{score, EvalOptions, Score, Scratch};
use crate::polish::{add_distinct, Polisher};
use crate::profile::Graph;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use std::time::Instant;

#[derive(Debug, Clone, PartialEq)]
pub struct PsoSettings {
    pub particles: usize,
    pub iterations: usize,
    pub seed: u64,
    /// Worker threads; 0 means one per core.
    pub threads: usize,
    /// Start three particles at all-retain, all-swap and all-recompute (an extension of the
    /// paper, which starts every particle at random).
    pub seed_extremes: bool,
    /// Probability that a unit of a particle is reset to a random action after its sweep
    /// (an extension; 0 reproduces the paper).
    pub mutation: f64,
    /// Stop early when the best plan has not improved for this many iterations (None: never).
    pub patience: Option<usize>,
    /// Skip particles at a fixed point of the sweep (exact; off only to test that it is).
    pub skip_fixed_points: bool,
    /// Plans to start particles at (after the extremes), such as the checkpointing recipes and
    /// the heuristics' plans, so the search is never worse than they are. Each must have one
    /// action per unit.
    pub seeds: Vec<Vec<Action>>,
    /// Whether `make_plan` seeds the swarm with the heuristic methods' plans.
    pub seed_heuristics: bool,
    /// After the swarm, polish the best plans by local search (crate::polish: single and pair
    /// moves, ejection chains; an extension; it only ever improves the result, and is
    /// deterministic whatever the thread count).
    pub polish: bool,
    /// How many plans the polish starts from: the swarm's best, then the next best distinct
    /// personal bests. The best polished plan wins.
    pub polish_starts: usize,
    /// With the polish: after it, run this many more swarms of `particles / 8` particles from
    /// random plans (each with its own seed derived from `seed`) and polish each one's best (an
    /// extension; it only ever improves the result).
    pub restarts: usize,
    /// With the polish: then polish at most this many plans found between polished plans by
    /// path relinking (crate::relink; an extension; it only ever improves the result).
    pub relinks: usize,
}

impl Default for PsoSettings {
    fn default() -> Self {
        PsoSettings {
            particles: 500,
            iterations: 500,
            seed: 0,
            threads: 0,
            seed_extremes: true,
            mutation: 0.0,
            patience: None,
            skip_fixed_points: true,
            seeds: Vec::new(),
            seed_heuristics: true,
            polish: true,
            polish_starts: 3,
            restarts: 3,
            relinks: 6,
        }
    }
}

/// Per-iteration record of the search. Times are the predicted step times of feasible particles
/// (None when no particle of that iteration was feasible).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    pub best: Vec<Option<f64>>,
    pub mean: Vec<Option<f64>>,
    pub worst: Vec<Option<f64>>,
    pub feasible: Vec<usize>,
    pub elapsed: Vec<f64>,
    pub evaluations: u64,
}

#[derive(Debug, Clone)]
pub struct PsoResult {
    pub actions: Vec<Action>,
    pub score: Score,
    pub trace: Trace,
}

fn particle_rng(seed: u64, particle: usize, iteration: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(((particle as u64) << 32) ^ iteration);
    rng
}

fn random_plan(n: usize, rng: &mut ChaCha8Rng) -> Vec<Action> {
    (0..n).map(|_| Action::ALL[rng.gen_range(0..3)]).collect()
}

/// One particle's sweep (Algorithm 3, lines 4-13). Returns its new score and evaluation count.
fn sweep(
    g: &Graph,
    budget: u64,
    opts: &EvalOptions,
    scratch: &mut Scratch,
    cur: &mut [Action],
    mut cur_score: Option<Score>,
    p1: &[Action],
    p2: &[Action],
) -> (Score, u64) {
    let mut evals = 0u64;
    for j in 0..cur.len() {
        let (c1, c2) = (p1[j], p2[j]);
        let orig = cur[j];
        if c1 == c2 {
            if orig != c1 {
                cur[j] = c1;
                cur_score = None;
            }
            continue;
        }
        let mut eval_with = |a: Action, cur: &mut [Action]| -> Score {
            if orig == a {
                if let Some(s) = cur_score {
                    return s;
                }
            }
            cur[j] = a;
            evals += 1;
            score(g, cur, budget, opts, scratch)
        };
        let o1 = eval_with(c1, cur);
        let o2 = eval_with(c2, cur);
        if o1.better_than(&o2) {
            cur[j] = c1;
            cur_score = Some(o1);
        } else {
            cur[j] = c2;
            cur_score = Some(o2);
        }
    }
    match cur_score {
        Some(s) => (s, evals),
        None => (score(g, cur, budget, opts, scratch), evals + 1),
    }
}

/// The index of the best score (the first of equal ones).
pub(crate) fn argbest(scores: &[Score]) -> usize {
    let mut b = 0;
    for (i, s) in scores.iter().enumerate() {
        if s.better_than(&scores[b]) {
            b = i;
        }
    }
    b
}

/// The settings of restart `r`: a smaller swarm from random plans, with a seed of its own, and
/// nothing after it.
fn restart_settings(settings: &PsoSettings, r: usize) -> PsoSettings {
    PsoSettings {
        particles: (settings.particles / 8).max(1),
        seed: settings.seed.wrapping_add(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(r as u64 + 1)),
        seed_extremes: false,
        seeds: Vec::new(),
        polish: false,
        restarts: 0,
        relinks: 0,
        ..settings.clone()
    }
}

/// Run the search. `on_iteration` is called after every iteration of the (first) swarm with
/// (iteration, best score).
pub fn search(
    g: &Graph,
    budget: u64,
    opts: &EvalOptions,
    settings: &PsoSettings,
    mut on_iteration: impl FnMut(usize, &Score),
) -> Result<PsoResult> {
    if settings.particles == 0 {
        return Err(CoreError::InvalidSetting("particles must be at least 1".into()));
    }
    if !(0.0..=1.0).contains(&settings.mutation) {
        return Err(CoreError::InvalidSetting(format!(
            "mutation is a probability in [0, 1], got {}",
            settings.mutation
        )));
    }
    if let Some(bad) = settings.seeds.iter().find(|s| s.len() != g.n) {
        return Err(CoreError::InvalidSetting(format!(
            "a seed plan has {} actions but the profile has {} units",
            bad.len(),
            g.n
        )));
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(settings.threads)
        .build()
        .map_err(|e| CoreError::InvalidSetting(format!("cannot start {} threads: {e}", settings.threads)))?;
    let Swarm { mut gbest, pbest, pbest_scores, mut trace, mut evaluations } =
        swarm(g, budget, opts, settings, &pool, &mut on_iteration);
    if settings.polish {
        // The swarm's best, then the best personal bests whose step time differs from every
        // start's so far (plans of the same time are mostly the same plan: a unit without
        // activations swapped instead of retained).
        let mut order: Vec<usize> = (0..pbest.len()).collect();
        order.sort_by(|&x, &y| pbest_scores[x].cmp_key(&pbest_scores[y]).then(x.cmp(&y)));
        let mut starts = vec![gbest.clone()];
        for &i in &order {
            if starts.len() >= settings.polish_starts.max(1) {
                break;
            }
            if starts.iter().all(|(p, ps)| *p != pbest[i] && ps.time != pbest_scores[i].time) {
                starts.push((pbest[i].clone(), pbest_scores[i]));
            }
        }
        let polished = crate::polish::polish(g, budget, opts, &pool, starts).expect("the swarm's best is a start");
        evaluations += polished.evaluations;
        if polished.best.1.better_than(&gbest.1) {
            gbest = polished.best;
        }
        let mut plans = polished.plans;
        let mut polisher = Polisher::new(g, budget, opts, &pool);
        for r in 0..settings.restarts {
            let restart = swarm(g, budget, opts, &restart_settings(settings, r), &pool, &mut |_, _| {});
            evaluations += restart.evaluations;
            let (p, ps) = polisher.polish(restart.gbest.0, restart.gbest.1);
            if ps.better_than(&gbest.1) {
                gbest = (p.clone(), ps);
            }
            add_distinct(&mut plans, p, ps);
        }
        evaluations += polisher.evaluations();
        if settings.relinks > 0 {
            let (best, evals) = crate::relink::relink(g, budget, opts, &pool, plans, settings.relinks);
            evaluations += evals;
            if let Some((p, ps)) = best {
                if ps.better_than(&gbest.1) {
                    gbest = (p, ps);
                }
            }
        }
        if let Some(last) = trace.best.last_mut() {
            if gbest.1.feasible {
                *last = Some(gbest.1.time);
            }
        }
    }
    trace.evaluations = evaluations;
    Ok(PsoResult { actions: gbest.0, score: gbest.1, trace })
}

/// What a swarm ends with.
struct Swarm {
    gbest: (Vec<Action>, Score),
    pbest: Vec<Vec<Action>>,
    pbest_scores: Vec<Score>,
    trace: Trace,
    evaluations: u64,
}

/// The swarm itself (Algorithms 1 and 3), settings checked.
fn swarm(
    g: &Graph,
    budget: u64,
    opts: &EvalOptions,
    settings: &PsoSettings,
    pool: &rayon::ThreadPool,
    on_iteration: &mut dyn FnMut(usize, &Score),
) -> Swarm {
    let n = g.n;
    let m = settings.particles;
    let started = Instant::now();
    let extremes = if settings.seed_extremes { 3 } else { 0 };
    let mut positions: Vec<Vec<Action>> = (0..m)
        .map(|i| {
            if i < extremes {
                vec![Action::ALL[i]; n]
            } else if i < extremes + settings.seeds.len() {
                settings.seeds[i - extremes].clone()
            } else {
                random_plan(n, &mut particle_rng(settings.seed, i, u64::MAX))
            }
        })
        .collect();
    let mut scores: Vec<Score> = pool.install(|| {
        positions
            .par_iter()
            .map_init(|| Scratch::new(n), |s, p| score(g, p, budget, opts, s))
            .collect()
    });
    let mut evaluations = m as u64;
    let mut pbest = positions.clone();
    let mut pbest_scores = scores.clone();
    let b = argbest(&scores);
    let mut gbest = (positions[b].clone(), scores[b]);
    let mut trace = Trace::default();
    let mut since_improved = 0usize;
    // Fixed points of the sweep: the particle did not move in its last sweep and neither its P1
    // nor its P2 has changed since (only without mutation, which is random).
    let mut unmoved = vec![false; m];
    let mut pbest_changed = vec![true; m];
    let mut last_p1: Vec<Action> = Vec::new();

    for it in 0..settings.iterations {
        let p1 = positions[argbest(&scores)].clone();
        let same_p1 = p1 == last_p1;
        let results: Vec<(Score, u64, bool)> = pool.install(|| {
            positions
                .par_iter_mut()
                .zip(scores.par_iter())
                .zip(pbest.par_iter())
                .enumerate()
                .map_init(
                    || (Scratch::new(n), Vec::new()),
                    |(scratch, before), (i, ((cur, &s), p2))| {
                        if settings.skip_fixed_points && settings.mutation == 0.0 && same_p1 && unmoved[i] && !pbest_changed[i] {
                            return (s, 0, true);
                        }
                        before.clear();
                        before.extend_from_slice(cur);
                        let (mut sc, mut ev) = sweep(g, budget, opts, scratch, cur, Some(s), &p1, p2);
                        if settings.mutation > 0.0 {
                            let mut rng = particle_rng(settings.seed, i, it as u64);
                            let mut changed = false;
                            for a in cur.iter_mut() {
                                if rng.gen::<f64>() < settings.mutation {
                                    *a = Action::ALL[rng.gen_range(0..3)];
                                    changed = true;
                                }
                            }
                            if changed {
                                sc = score(g, cur, budget, opts, scratch);
                                ev += 1;
                            }
                        }
                        (sc, ev, *before == *cur)
                    },
                )
                .collect()
        });
        let mut improved = false;
        last_p1 = p1;
        for (i, (s, ev, still)) in results.into_iter().enumerate() {
            evaluations += ev;
            scores[i] = s;
            unmoved[i] = still;
            pbest_changed[i] = false;
            if s.better_than(&pbest_scores[i]) {
                pbest_scores[i] = s;
                pbest[i].clone_from(&positions[i]);
                pbest_changed[i] = true;
            }
            if s.better_than(&gbest.1) {
                gbest = (positions[i].clone(), s);
                improved = true;
            }
        }
        let feas: Vec<f64> = scores.iter().filter(|s| s.feasible).map(|s| s.time).collect();
        trace.best.push(if gbest.1.feasible { Some(gbest.1.time) } else { None });
        trace.mean.push(if feas.is_empty() { None } else { Some(feas.iter().sum::<f64>() / feas.len() as f64) });
        trace.worst.push(feas.iter().cloned().reduce(f64::max));
        trace.feasible.push(feas.len());
        trace.elapsed.push(started.elapsed().as_secs_f64());
        on_iteration(it, &gbest.1);
        since_improved = if improved { 0 } else { since_improved + 1 };
        if let Some(p) = settings.patience {
            if since_improved >= p {
                break;
            }
        }
    }
    Swarm { gbest, pbest, pbest_scores, trace, evaluations }
}
