//! HOME's particle swarm search (Algorithms 1 and 3).
//!
//! A particle is a plan (one action per unit). Each iteration every particle sweeps its units in
//! order; for unit j it tries the action of the last iteration's best particle (P1) and the
//! action of its own best-ever plan (P2), evaluating each with the evaluator, and keeps the
//! better (P2 on a tie, as in the paper). Two legitimate speed-ups that do not change the result:
//! when `P1[j] == P2[j]` the choice is forced and nothing is evaluated, and a candidate equal to the
//! particle's current plan reuses its known score; and a particle whose last sweep left it where
//! it was, with the same P1 and P2 as then, is at a fixed point of the sweep and is not swept
//! again (the sweep is deterministic). Particles are updated in parallel (rayon); all
//! randomness comes from per-particle generators derived from the seed, so the result does not
//! depend on the thread count.
//!
//! Extensions after the swarm (`PsoSettings`): the polish of its best plans (crate::polish),
//! restarts (smaller swarms from random plans, each best polished) and path relinking between
//! the polished plans (crate::relink). Each only adds candidates, so none makes the result worse.
//! The polish's starts and the restarts are independent of each other and run at once, each on
//! its own (its parallel scans share the threads): on two threads one's idle time is the
//! others' work.
//!
//! The swarm and its extensions run in a [`Space`]: one dimension per unit, or (the block-wise
//! search, crate::blockwise) one per place of a class of repeated blocks. A sweep then sets one
//! dimension (a group of units) at a time. The candidate the particle's plan already has keeps
//! its score, and the other is evaluated with that score as a bound (crate::incremental): one
//! that cannot beat it stops early, which changes nothing but the work. Each candidate resumes
//! from the particle's own state at the stage its dimension can first affect (saved by the
//! sweep's earlier candidates), which changes nothing but the work either. Particles that
//! converge try the same plans (on mobilenet_v2 at 0.75, 40% of the swarm's candidates were
//! tried before by it): a plan the search evaluated before (in an earlier iteration, or an
//! earlier phase) is answered from what that evaluation found (crate::memo: the search's memo,
//! which the threads read during an iteration and which learns between iterations), the same
//! answer.

use crate::action::Action;
use crate::error::{CoreError, Result};
use crate::evaluator::{EvalOptions, Score};
use crate::incremental::{Context, Worker};
use crate::memo::{normalized, pack, ScoreMemo};
use crate::polish::{add_distinct, Memos, Polisher};
use crate::profile::Graph;
use crate::space::Space;
use crate::threads::Threads;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
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
    /// With the polish: beside it (at once), run this many more swarms of `particles / 8`
    /// particles from random plans (each with its own seed derived from `seed`) and polish each
    /// one's best (an extension; it only ever improves the result).
    pub restarts: usize,
    /// With the polish: then polish at most this many plans found between polished plans by
    /// path relinking (crate::relink; an extension; it only ever improves the result).
    pub relinks: usize,
    /// Classes of equal repeated blocks: per class, the unit ranges `(first, last)` of its
    /// blocks (crate::recipes::repeated_block_classes; `make_plan` fills it from the unit names).
    pub blocks: Vec<Vec<(usize, usize)>>,
    /// Search block-wise (crate::blockwise) where the profile has repeated blocks: None (the
    /// default) when it has more than [`crate::blockwise::FULL_SEARCH_UNITS`] units, Some(true)
    /// always, Some(false) never.
    pub block_wise: Option<bool>,
    /// Plans may swap (false: retain and recompute only, for an engine that cannot swap; seeds
    /// with swaps are then left out).
    pub swaps: bool,
    /// The swarm, polish, restarts and path relinking answer a plan they evaluated before from
    /// what the evaluation found (crate::memo; exact: same plans and evaluation counts; off only
    /// to test that it is).
    pub memo: bool,
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
            blocks: Vec::new(),
            block_wise: None,
            swaps: true,
            memo: true,
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
    /// Forward and backward stages the evaluations simulated (a full evaluation simulates two per
    /// unit; incremental ones fewer: crate::incremental).
    pub stages: u64,
    /// The search's phases in order: (name, seconds, evaluations, stages).
    pub phases: Vec<Phase>,
}

/// One phase of the search: its name, wall time, evaluations and simulated stages.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Phase {
    pub name: String,
    pub seconds: f64,
    pub evaluations: u64,
    pub stages: u64,
    /// The predicted step time of the best feasible plan after the phase.
    pub best: Option<f64>,
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

/// A random plan of `space` (one random action per dimension).
fn random_plan(space: &Space, rng: &mut ChaCha8Rng) -> Vec<Action> {
    let acts = space.actions();
    let per_dim: Vec<Action> = (0..space.dims()).map(|_| acts[rng.gen_range(0..acts.len())]).collect();
    space.expand(&per_dim)
}

/// A sweep's view of the plans the search evaluated before this iteration (crate::memo), and what
/// it learns: kept in the memo after the iteration, in particle order, so that what the
/// memo knows (and so the work) does not depend on the thread count.
struct SweepMemo<'a> {
    known: &'a ScoreMemo,
    key: Vec<u64>,
    learnt: Learnt,
}

/// What sweeps learnt: the keys of the plans they evaluated (one after the other), what each
/// evaluation answered with its bound, and the questions the memo answered.
#[derive(Debug, Default)]
struct Learnt {
    keys: Vec<u64>,
    answers: Vec<(Option<Score>, Option<Score>)>,
    hits: u64,
}

impl Learnt {
    fn keep_in(self, known: &mut ScoreMemo) {
        let words = self.keys.len().checked_div(self.answers.len()).unwrap_or(0);
        for (key, (bound, s)) in self.keys.chunks_exact(words.max(1)).zip(self.answers) {
            known.put_key(key, bound, s);
        }
        known.hits += self.hits;
    }
}

impl<'a> SweepMemo<'a> {
    fn new(known: &'a ScoreMemo) -> Self {
        SweepMemo { known, key: Vec::new(), learnt: Learnt::default() }
    }

    /// [`Context::score_changed`] of `plan`, answered from the memo where it knows it (the answer
    /// [`normalized`]: the same choice of candidate).
    fn score_changed(&mut self, ctx: &Context, plan: &[Action], changed_from: usize, bound: Option<Score>, w: &mut Worker) -> Option<Score> {
        if !self.known.enabled() {
            return ctx.score_changed(plan, changed_from, bound, w);
        }
        pack(plan, &mut self.key);
        if let Some(known) = self.known.peek_key(&self.key, bound) {
            self.learnt.hits += 1;
            return known;
        }
        let s = ctx.score_changed(plan, changed_from, bound, w);
        self.learnt.keys.extend_from_slice(&self.key);
        self.learnt.answers.push((bound, s));
        normalized(s, bound)
    }
}

/// One particle's sweep (Algorithm 3, lines 4-13) over the dimensions of `space`. Returns its
/// new score and evaluation count. Each candidate is scored resumed from the particle's own
/// states, saved as the sweep goes (crate::incremental's `Context::score_changed`): the
/// dimensions before one do not change while it is tried, so neither does the step up to it.
#[allow(clippy::too_many_arguments)]
fn sweep(
    ctx: &Context,
    memo: &mut SweepMemo,
    space: &Space,
    w: &mut Worker,
    cur: &mut [Action],
    mut cur_score: Option<Score>,
    p1: &[Action],
    p2: &[Action],
) -> (Score, u64) {
    let mut evals = 0u64;
    ctx.start_changes(w);
    for j in 0..space.dims() {
        let (c1, c2) = (space.action(p1, j), space.action(p2, j));
        let orig = space.action(cur, j);
        let from = space.first(j);
        if c1 == c2 {
            if orig != c1 {
                ctx.changed(cur, from, w);
                space.set(cur, j, c1);
                cur_score = None;
            }
            continue;
        }
        // The candidate the plan already has keeps its score; the other is evaluated with the
        // first score known as a bound (None: strictly worse than it).
        let (o1, o2) = match cur_score.filter(|_| orig == c1 || orig == c2) {
            Some(s) if orig == c1 => {
                space.set(cur, j, c2);
                evals += 1;
                (Some(s), memo.score_changed(ctx, cur, from, Some(s), w))
            }
            Some(s) => {
                space.set(cur, j, c1);
                evals += 1;
                (memo.score_changed(ctx, cur, from, Some(s), w), Some(s))
            }
            None => {
                space.set(cur, j, c1);
                let o1 = memo.score_changed(ctx, cur, from, None, w).expect("no bound");
                space.set(cur, j, c2);
                let o2 = memo.score_changed(ctx, cur, from, Some(o1), w);
                evals += 2;
                (Some(o1), o2)
            }
        };
        // The better one, P2's on a tie.
        let (a, s) = match (o1, o2) {
            (Some(x), Some(y)) if x.better_than(&y) => (c1, x),
            (Some(_), Some(y)) => (c2, y),
            (Some(x), None) => (c1, x),
            (None, Some(y)) => (c2, y),
            (None, None) => unreachable!("one candidate is scored in full"),
        };
        if a != orig {
            ctx.changed(cur, from, w);
        }
        space.set(cur, j, a);
        cur_score = Some(s);
    }
    match cur_score {
        Some(s) => (s, evals),
        None => (memo.score_changed(ctx, cur, cur.len() - 1, None, w).expect("no bound"), evals + 1),
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
    if !settings.swaps && settings.seeds.iter().any(|s| s.contains(&Action::Swap)) {
        return Err(CoreError::InvalidSetting("a seed plan swaps, but the search may not (swaps = false)".into()));
    }
    crate::blockwise::check_blocks(g.n, &settings.blocks)?;
    let pool = Threads::new(settings.threads)?;
    let mut trace = Trace::default();
    let best = if crate::blockwise::block_wise(g.n, settings) {
        crate::blockwise::search(g, budget, opts, settings, &pool, &mut trace, &mut on_iteration)
    } else {
        let space = if settings.swaps { Space::full(g.n) } else { Space::full(g.n).without_swaps() };
        pipeline(g, budget, opts, settings, &pool, &space, &settings.seeds, &mut trace, "", &mut on_iteration).0
    };
    let (actions, score) = best;
    if let Some(last) = trace.best.last_mut() {
        if score.feasible {
            *last = Some(score.time);
        }
    }
    trace.evaluations = trace.phases.iter().map(|p| p.evaluations).sum();
    trace.stages = trace.phases.iter().map(|p| p.stages).sum();
    Ok(PsoResult { actions, score, trace })
}

/// The swarm and its extensions in `space` (seeds are projected onto it): returns the best plan
/// and the distinct polished plans. Phases are recorded in `trace` (names prefixed by `tag`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn pipeline(
    g: &Graph,
    budget: u64,
    opts: &EvalOptions,
    settings: &PsoSettings,
    pool: &Threads,
    space: &Space,
    seeds: &[Vec<Action>],
    trace: &mut Trace,
    tag: &str,
    on_iteration: &mut dyn FnMut(usize, &Score),
) -> ((Vec<Action>, Score), Vec<(Vec<Action>, Score)>) {
    // A phase's wall time (the polish and the restarts run at once: theirs overlap).
    let phase = |trace: &mut Trace, name: &str, seconds: f64, evaluations: u64, stages: u64, best: &Score| {
        trace.phases.push(Phase {
            name: format!("{tag}{name}"),
            seconds,
            evaluations,
            stages,
            best: best.feasible.then_some(best.time),
        });
    };
    let clock = Instant::now();
    let projected: Vec<Vec<Action>> = seeds.iter().map(|p| space.project(p)).collect();
    let mut memos = Memos::new(g.n, settings.memo);
    let first = Swarm::run(g, budget, opts, &PsoSettings { seeds: projected, ..settings.clone() }, pool, space, &mut memos.budget, on_iteration);
    trace.best = first.trace.best;
    trace.mean = first.trace.mean;
    trace.worst = first.trace.worst;
    trace.feasible = first.trace.feasible;
    trace.elapsed = first.trace.elapsed;
    phase(trace, "swarm", clock.elapsed().as_secs_f64(), first.evaluations, first.stages, &first.gbest.1);
    let mut gbest = first.gbest;
    let mut plans = Vec::new();
    if !settings.polish {
        add_distinct(&mut plans, gbest.0.clone(), gbest.1);
        return (gbest, plans);
    }
    let mut polisher = Polisher::new(g, budget, opts, pool, space);
    polisher.memos = memos;
    if polisher.is_optimal(&gbest.1) {
        // No plan is faster: only the swaps it does without are undone.
        let clock = Instant::now();
        let (p, ps) = polisher.tidied(gbest.0, gbest.1);
        phase(trace, "tidy", clock.elapsed().as_secs_f64(), polisher.evaluations(), polisher.stages(), &ps);
        add_distinct(&mut plans, p.clone(), ps);
        return ((p, ps), plans);
    }
    // The swarm's best, then the best personal bests whose step time differs from every start's
    // so far (plans of the same time are mostly the same plan: a unit without activations
    // swapped instead of retained).
    let (pbest, pbest_scores) = (first.pbest, first.pbest_scores);
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
    // The polish of the starts and the restarts (smaller swarms from random plans, each best
    // polished) are independent of each other: they run at once, the restarts each on its own
    // with memos of its own (what the polish learnt saved them nothing: the same stages were
    // simulated with it), and are taken in order, restarts up to the first optimal plan; when
    // the polish's plan is optimal, none (their work is counted either way).
    let restart_ids: Vec<usize> = (0..settings.restarts).collect();
    let ((polished, polish_done), (runs, restarts_done)) = pool.join(
        || {
            let clock = Instant::now();
            let polished = crate::polish::polish(g, budget, opts, pool, space, starts, &mut polisher.memos).expect("the swarm's best is a start");
            (polished, clock.elapsed())
        },
        || {
            let clock = Instant::now();
            let runs = pool.map(
                &restart_ids,
                || (),
                |_, &r| {
                    let mut memos = Memos::new(g.n, settings.memo);
                    let swarm = Swarm::run(g, budget, opts, &restart_settings(settings, r), pool, space, &mut memos.budget, &mut |_, _| {});
                    let mut polisher = Polisher::new(g, budget, opts, pool, space);
                    polisher.memos = memos;
                    let best = polisher.polish(swarm.gbest.0, swarm.gbest.1);
                    (best, swarm.evaluations + polisher.evaluations(), swarm.stages + polisher.stages())
                },
            );
            (runs, clock.elapsed())
        },
    );
    if polished.best.1.better_than(&gbest.1) {
        gbest = polished.best;
    }
    phase(trace, "polish", polish_done.as_secs_f64(), polished.evaluations, polished.stages, &gbest.1);
    plans = polished.plans;
    let (mut restart_evals, mut restart_stages) = (0u64, 0u64);
    let mut optimal = polisher.is_optimal(&gbest.1);
    for ((p, ps), evals, stages) in runs {
        restart_evals += evals;
        restart_stages += stages;
        if optimal {
            continue;
        }
        if ps.better_than(&gbest.1) {
            gbest = (p.clone(), ps);
        }
        add_distinct(&mut plans, p, ps);
        optimal = polisher.is_optimal(&gbest.1);
    }
    if settings.restarts > 0 {
        phase(trace, "restarts", restarts_done.as_secs_f64(), restart_evals, restart_stages, &gbest.1);
    }
    if settings.relinks > 0 && !polisher.is_optimal(&gbest.1) {
        let clock = Instant::now();
        let (best, evals, stages) = crate::relink::relink(g, budget, opts, pool, space, plans.clone(), settings.relinks, &mut polisher.memos);
        if let Some((p, ps)) = best {
            if ps.better_than(&gbest.1) {
                gbest = (p.clone(), ps);
            }
            add_distinct(&mut plans, p, ps);
        }
        phase(trace, "relink", clock.elapsed().as_secs_f64(), evals, stages, &gbest.1);
    }
    (gbest, plans)
}

/// What a swarm ends with.
struct Swarm {
    gbest: (Vec<Action>, Score),
    pbest: Vec<Vec<Action>>,
    pbest_scores: Vec<Score>,
    trace: Trace,
    evaluations: u64,
    stages: u64,
}

impl Swarm {
    /// The swarm itself (Algorithms 1 and 3) over the dimensions of `space`, settings checked
    /// (seeds are plans of `space`); `known` is what the search knows of plans' scores under
    /// this budget (crate::memo), which the swarm reads and adds to.
    #[allow(clippy::too_many_arguments)]
    fn run(
        g: &Graph,
        budget: u64,
        opts: &EvalOptions,
        settings: &PsoSettings,
        pool: &Threads,
        space: &Space,
        known: &mut ScoreMemo,
        on_iteration: &mut dyn FnMut(usize, &Score),
    ) -> Swarm {
        let n = g.n;
        let m = settings.particles;
        let started = Instant::now();
        let ctx = Context::new(g, budget, opts);
        let extremes = if settings.seed_extremes { 3 } else { 0 };
        let mut positions: Vec<Vec<Action>> = (0..m)
            .map(|i| {
                if i < extremes && space.allows(Action::ALL[i]) {
                    vec![Action::ALL[i]; n]
                } else if i < extremes {
                    // the all-swap particle of a space without swaps: a random one
                    random_plan(space, &mut particle_rng(settings.seed, i, u64::MAX))
                } else if i < extremes + settings.seeds.len() {
                    settings.seeds[i - extremes].clone()
                } else {
                    random_plan(space, &mut particle_rng(settings.seed, i, u64::MAX))
                }
            })
            .collect();
        let initial: Vec<(Score, u64)> = pool.map(
            &positions,
            || Worker::new(n),
            |w, p| {
                let before = w.stages;
                (ctx.score_full(p, None, w).expect("no bound"), w.stages - before)
            },
        );
        let mut stages: u64 = initial.iter().map(|x| x.1).sum();
        let mut scores: Vec<Score> = initial.into_iter().map(|x| x.0).collect();
        let mut evaluations = m as u64;
        let mut pbest = positions.clone();
        let mut pbest_scores = scores.clone();
        let b = argbest(&scores);
        let mut gbest = (positions[b].clone(), scores[b]);
        let mut trace = Trace::default();
        let mut since_improved = 0usize;
        // Fixed points of the sweep: the particle did not move in its last sweep and neither its
        // P1 nor its P2 has changed since (only without mutation, which is random).
        let mut unmoved = vec![false; m];
        let mut pbest_changed = vec![true; m];
        let mut last_p1: Vec<Action> = Vec::new();

        for it in 0..settings.iterations {
            let p1 = positions[argbest(&scores)].clone();
            let same_p1 = p1 == last_p1;
            let results: Vec<(Score, u64, bool, u64, Learnt)> = pool.map_mut(
                &mut positions,
                || (Worker::new(n), Vec::new(), SweepMemo::new(known)),
                |(w, before, memo), i, cur| {
                    let (s, p2) = (scores[i], &pbest[i]);
                    if settings.skip_fixed_points && settings.mutation == 0.0 && same_p1 && unmoved[i] && !pbest_changed[i] {
                        return (s, 0, true, 0, Learnt::default());
                    }
                    let stages_before = w.stages;
                    before.clear();
                    before.extend_from_slice(cur);
                    let (mut sc, mut ev) = sweep(&ctx, memo, space, w, cur, Some(s), &p1, p2);
                    if settings.mutation > 0.0 {
                        let mut rng = particle_rng(settings.seed, i, it as u64);
                        let mut changed = false;
                        for k in 0..space.dims() {
                            if rng.gen::<f64>() < settings.mutation {
                                let acts = space.actions();
                                space.set(cur, k, acts[rng.gen_range(0..acts.len())]);
                                changed = true;
                            }
                        }
                        if changed {
                            sc = ctx.score_full(cur, None, w).expect("no bound");
                            ev += 1;
                        }
                    }
                    (sc, ev, *before == *cur, w.stages - stages_before, std::mem::take(&mut memo.learnt))
                },
            );
            let mut improved = false;
            last_p1 = p1;
            for (i, (s, ev, still, st, learnt)) in results.into_iter().enumerate() {
                learnt.keep_in(known);
                evaluations += ev;
                stages += st;
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
            if ctx.is_optimal(&gbest.1) {
                // No plan is faster than the best.
                break;
            }
            since_improved = if improved { 0 } else { since_improved + 1 };
            if let Some(p) = settings.patience {
                if since_improved >= p {
                    break;
                }
            }
        }
        Swarm { gbest, pbest, pbest_scores, trace, evaluations, stages }
    }
}
