//! Parsing a program's `Debug` form back ([`Program::parse`]), so a failing case
//! printed by a property can be pasted into a regression test.

use gantry::Promotion;

use crate::program::{BufferSpec, Cmd, Dev, Launch, Op, Program, Span, WMode};

fn parse_promotion(s: &str) -> Result<Promotion, String> {
    match s {
        "none" => Ok(Promotion::None),
        "local" => Ok(Promotion::Local),
        "private" => Ok(Promotion::Private),
        _ => Err(format!("bad promotion `{s}`")),
    }
}

/// Parses what [`write_header`](crate::write_header) wrote: the words after `buffers:` up to `queues:`, and
/// the words after `queues:` up to the next section.
pub(crate) fn parse_header(
    buffers: &[&str],
    queues: &[&str],
) -> Result<(Vec<BufferSpec>, Vec<bool>), String> {
    let mut specs = Vec::new();
    for chunk in buffers.chunks(3) {
        let [name, _, seed] = chunk else { return Err(format!("bad buffer `{chunk:?}`")) };
        let len = name.split_once('[').ok_or("buffer length")?.1.trim_end_matches(']');
        specs.push(BufferSpec { len: num(len)? as usize, seed: num(seed)? as u32 });
    }
    Ok((specs, queues.chunks(2).map(|c| c.get(1) == Some(&"in-order;")).collect()))
}

pub(crate) fn num(s: &str) -> Result<u64, String> {
    let s = s.trim_end_matches([',', ';', ')']);
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    }
    .map_err(|e| format!("bad number `{s}`: {e}"))
}

fn parse_span(s: &str) -> Result<Span, String> {
    let s = s.trim_end_matches([',', ';']);
    let err = || format!("bad range `{s}`");
    let rest = s.strip_prefix('b').ok_or_else(err)?;
    let (b, rest) = rest.split_once('[').ok_or_else(err)?;
    let (a, e) = rest.trim_end_matches(']').split_once("..").ok_or_else(err)?;
    Ok(Span { buf: num(b)? as usize, start: num(a)? as usize, end: num(e)? as usize })
}

pub(crate) fn parse_list(s: &str) -> Vec<&str> {
    let inner = s.trim().strip_prefix('[').and_then(|s| s.strip_suffix(']')).unwrap_or(s).trim();
    if inner.is_empty() {
        vec![]
    } else {
        inner.split(", ").map(str::trim).collect()
    }
}

fn parse_salt(w: &str) -> Result<u32, String> {
    Ok(num(w.strip_prefix("salt=").ok_or_else(|| format!("expected salt=, got `{w}`"))?)? as u32)
}

fn parse_cmd(w: &[&str]) -> Result<Cmd, String> {
    let (kind, rest) = w.split_first().ok_or("empty command")?;
    let words = |from: usize, to: usize| rest[from.min(rest.len())..to.min(rest.len())].join(" ");
    match *kind {
        "kernel" | "kernel(nd" | "kernel(map)" | "host_task" => {
            let (launch, rest) = match *kind {
                "kernel(nd" => (Launch::Nd(num(rest.get(1).ok_or("nd local")?)? as usize), &rest[2..]),
                "kernel(map)" => (Launch::Map, rest),
                _ => (Launch::Flat, rest),
            };
            let salt = parse_salt(rest.first().ok_or("salt")?)?;
            let r = rest.iter().position(|&x| x == "reads").ok_or("reads")?;
            let wr = rest.iter().position(|&x| x == "writes").ok_or("writes")?;
            let pr = rest.iter().position(|&x| x == "promote").unwrap_or(rest.len());
            let reads = parse_list(&rest[r + 1..wr].join(" "))
                .into_iter()
                .map(parse_span)
                .collect::<Result<_, _>>()?;
            let promote = parse_list(&rest[(pr + 1).min(rest.len())..].join(" "))
                .into_iter()
                .map(|x| {
                    let (b, p) = x.split_once(' ').ok_or_else(|| format!("bad promotion `{x}`"))?;
                    Ok((num(b.trim_start_matches('b'))? as usize, parse_promotion(p)?))
                })
                .collect::<Result<_, String>>()?;
            let writes = parse_list(&rest[wr + 1..pr].join(" "))
                .into_iter()
                .map(|x| {
                    let (s, m) = x.split_once(' ').ok_or_else(|| format!("bad write `{x}`"))?;
                    let m = match m {
                        "w" => WMode::Write,
                        "rw" => WMode::ReadWrite,
                        "discard" => WMode::DiscardWrite,
                        _ => return Err(format!("bad mode `{m}`")),
                    };
                    Ok((parse_span(s)?, m))
                })
                .collect::<Result<_, String>>()?;
            Ok(if *kind == "host_task" {
                Cmd::HostTask { reads, writes, salt }
            } else {
                Cmd::Kernel { reads, writes, salt, launch, promote }
            })
        }
        "copy" => Ok(Cmd::Copy { src: parse_span(&words(0, 1))?, dst: parse_span(&words(2, 3))? }),
        "fill" => Ok(Cmd::Fill { span: parse_span(&words(0, 1))?, value: num(&words(2, 3))? as u32 }),
        "copy_from_host" => {
            Ok(Cmd::CopyFromHost { salt: parse_salt(&words(0, 1))?, dst: parse_span(&words(2, 3))? })
        }
        "copy_to_host" => Ok(Cmd::ReadBack { src: parse_span(&words(0, 1))? }),
        k => Err(format!("unknown command `{k}`")),
    }
}

pub(crate) fn parse_op(w: &[&str]) -> Result<Op, String> {
    let first = *w.first().ok_or("empty op")?;
    let target = |s: &str| num(s.trim_start_matches('#'));
    if first == "flush" {
        return Ok(Op::Flush);
    }
    let parse_dev = |d: &str| match d {
        "cpu" => Ok(Dev::Cpu),
        "sim" => Ok(Dev::Sim),
        _ => Err(format!("unknown device `{d}`")),
    };
    if let Some((qd, method)) = first.split_once('.').filter(|(qd, _)| qd.contains('@')) {
        let (q, d) = qd.split_once('@').expect("checked");
        let (queue, dev) = (num(q.trim_start_matches('q'))? as usize, parse_dev(d)?);
        return match method {
            "start_fusion()" => Ok(Op::StartFusion { queue, dev }),
            "cancel_fusion()" => Ok(Op::CancelFusion { queue, dev }),
            "complete_fusion(barriers)" | "complete_fusion(no_barriers)" => Ok(Op::CompleteFusion {
                queue,
                dev,
                barriers: method == "complete_fusion(barriers)",
                wait: w.get(1) == Some(&"wait"),
            }),
            _ => Err(format!("unknown queue method `{method}`")),
        };
    }
    if let Some((b, p)) = first.split_once(".set_promotion(") {
        return Ok(Op::SetPromotion {
            buf: num(b.trim_start_matches('b'))? as usize,
            promotion: parse_promotion(p.trim_end_matches(')'))?,
        });
    }
    if first == "drop" {
        return Ok(Op::Drop(num(w.get(1).ok_or("drop what")?.trim_start_matches('b'))? as usize));
    }
    if let Some(x) = first.strip_suffix(".wait()") {
        return Ok(match x.strip_prefix('#') {
            Some(k) => Op::Wait(num(k)? as usize),
            None => Op::QueueWait(num(x.trim_start_matches('q'))? as usize),
        });
    }
    if let Some(b) = first.strip_suffix(".to_vec()") {
        return Ok(Op::Snapshot(num(b.trim_start_matches('b'))? as usize));
    }
    if let Some(b) = first.strip_suffix(".write()") {
        let salt = parse_salt(w.get(1).ok_or("salt")?)?;
        return Ok(Op::HostUpdate { buf: num(b.trim_start_matches('b'))? as usize, salt });
    }
    let (q, d) = first.split_once('@').ok_or_else(|| format!("unknown op `{first}`"))?;
    let queue = num(q.trim_start_matches('q'))? as usize;
    let dev = match d {
        "cpu" => Dev::Cpu,
        "sim" => Dev::Sim,
        _ => return Err(format!("unknown device `{d}`")),
    };
    let after = w.iter().position(|&x| x == "after").unwrap_or(w.len());
    let deps = if after < w.len() {
        parse_list(&w[after + 1..].join(" "))
            .into_iter()
            .map(|d| target(d).map(|d| d as usize))
            .collect::<Result<_, _>>()?
    } else {
        vec![]
    };
    Ok(Op::Submit { queue, dev, deps, cmd: parse_cmd(&w[1..after])? })
}

impl Program {
    /// Parses the `Debug` form of a program (as printed by a failing property, also
    /// with its line breaks collapsed, as in a `.proptest-regressions` file). Anything
    /// after the closing brace is ignored.
    pub fn parse(text: &str) -> Result<Program, String> {
        let words: Vec<&str> = text.split_whitespace().collect();
        let pos = |w: &str| words.iter().position(|&x| x == w).ok_or_else(|| format!("missing `{w}`"));
        let (b, q) = (pos("buffers:")?, pos("queues:")?);
        let is_marker =
            |w: &str| w.len() > 1 && w.starts_with('#') && w[1..].bytes().all(|c| c.is_ascii_digit());
        let end = words.iter().position(|w| w.starts_with('}')).unwrap_or(words.len());
        let first_op = words.iter().position(|&w| is_marker(w)).unwrap_or(end);
        let (buffers, queues) = parse_header(&words[b + 1..q], &words[q + 1..first_op])?;
        let mut ops = Vec::new();
        let mut i = first_op;
        while i < end {
            let next = (i + 1..end).find(|&j| is_marker(words[j])).unwrap_or(end);
            let index = num(&words[i][1..])? as usize;
            if index != ops.len() {
                return Err(format!("op #{index} out of order"));
            }
            ops.push(parse_op(&words[i + 1..next]).map_err(|e| format!("op #{index}: {e}"))?);
            i = next;
        }
        Ok(Program { buffers, queues, ops })
    }
}
