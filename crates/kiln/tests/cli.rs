//! End-to-end tests of the `kiln` binary on the default model.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn model() -> PathBuf {
    kiln_hub::ensure_default_model().expect("default model")
}

fn refs() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/refs"))
}

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().expect("run kiln")
}

fn reference(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(refs().join(format!("{name}.json"))).unwrap()).unwrap()
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "kiln failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).expect("utf-8 stdout")
}

#[test]
fn tokenize_prints_reference_ids() {
    let m = model();
    let r = reference("p0");
    let out = stdout(&kiln(&["tokenize", "--model", m.to_str().unwrap(), r["prompt"].as_str().unwrap()]));
    let ids: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(ids, r["input_ids"]);
}

#[test]
fn greedy_run_streams_the_reference_continuation() {
    let m = model();
    let r = reference("p0");
    // p0's first near-tie is at step 11: the first 11 greedy tokens are exact.
    let out = kiln(&["run", "--model", m.to_str().unwrap(), "--temperature", "0", "-n", "11", r["prompt"].as_str().unwrap()]);
    let text = stdout(&out);
    let pieces: Vec<&str> = r["greedy"]["pieces"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    let want: String = pieces[..11].concat().replace('\u{2581}', " ");
    assert_eq!(text.trim_end_matches('\n'), want);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tok/s"), "timings go to stderr: {err}");
}

/// One token has no generation rate (the rate counts the tokens after the prompt's step).
#[test]
fn one_token_reports_no_generation_rate() {
    let m = model();
    let out = kiln(&["run", "--model", m.to_str().unwrap(), "--temperature", "0", "-n", "1", "The capital of France is"]);
    assert!(!stdout(&out).trim().is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("| generation: 1 token |"), "{err}");
}

#[test]
fn seeded_sampling_is_reproducible() {
    let m = model();
    let args = ["run", "--model", m.to_str().unwrap(), "--temperature", "1.0", "--seed", "42", "-n", "12", "Once upon a time"];
    let (a, b) = (stdout(&kiln(&args)), stdout(&kiln(&args)));
    assert_eq!(a, b);
    assert!(!a.trim().is_empty());
}

/// The prompt token counts of a `kiln run`/`kiln chat` run's report lines.
#[test]
fn logit_bias_bans_a_token_and_bad_biases_are_clear_errors() {
    let m = model();
    let m = m.to_str().unwrap();
    let first = |extra: &[&str]| {
        let mut args = vec!["run", "--model", m, "--temperature", "0", "-n", "1"];
        args.extend_from_slice(extra);
        args.push("The capital of France is");
        kiln(&args)
    };
    // (The run ends its text with a newline.)
    let greedy = stdout(&first(&[])).trim_end_matches('\n').to_string();
    let ids: Vec<u32> = serde_json::from_str(stdout(&kiln(&["tokenize", "--model", m, &greedy])).trim()).unwrap();
    // (`tokenize` puts BOS first.)
    assert_eq!(ids.len(), 2, "{greedy:?} is one token: {ids:?}");
    let ban = format!("{}=-100", ids[1]);
    let other = stdout(&first(&["--logit-bias", &ban])).trim_end_matches('\n').to_string();
    assert!(!other.is_empty() && other != greedy, "{other:?} against {greedy:?}");
    for (bias, needle) in
        [("12", "ID=BIAS"), ("x=1", "token id 'x'"), ("5=up", "bias 'up'"), ("5=inf", "finite"), ("999999999=1", "vocabulary")]
    {
        let o = first(&["--logit-bias", bias]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(needle), "--logit-bias {bias}: {err}");
    }
}

#[test]
fn json_flag_generates_one_json_object() {
    let m = model();
    let prompt = "Question: what is the capital of France? Answer in JSON with keys city and country.\nAnswer:";
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--model", m.to_str().unwrap(), "--temperature", "0", "-n", "60"];
        args.extend_from_slice(extra);
        args.push(prompt);
        kiln(&args)
    };
    let out = run(&["--json"]);
    let text = stdout(&out);
    let v: Value = serde_json::from_str(text.trim_end_matches('\n')).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v.is_object(), "{text:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("finish: Stop"));
    assert!(serde_json::from_str::<Value>(stdout(&run(&[])).trim_end_matches('\n')).is_err(), "unconstrained, not JSON");
}

fn prompt_counts(stderr: &str) -> Vec<usize> {
    stderr.lines().filter_map(|l| l.split("prompt: ").nth(1)?.split(' ').next()?.parse().ok()).collect()
}

/// Runs `kiln chat` greedily on `model` with `input` as stdin and at most `n` tokens a turn (and
/// `extra` flags); returns each turn's prompt token count and stderr. Fails if the command does.
fn chat_with(model: &std::path::Path, n: &str, extra: &[&str], input: &[u8]) -> (Vec<usize>, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["chat", "--model", model.to_str().unwrap(), "--temperature", "0", "-n", n])
        .args(extra)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    (prompt_counts(&err), err)
}

/// `chat_with` without extra flags.
fn chat(model: &std::path::Path, n: &str, input: &[u8]) -> (Vec<usize>, String) {
    chat_with(model, n, &[], input)
}

#[test]
fn chat_forgets_its_oldest_exchanges_when_the_context_fills() {
    // A context of 96 tokens and replies of 30: the third turn no longer fits with the first
    // two exchanges; a message longer than the context is refused, and the chat goes on.
    let long = format!("{}\n", "word ".repeat(200));
    let input = format!("Tell me a story about a dragon.\nAnd another one.\n{long}A third?\nok\n");
    let (prompts, err) = chat_with(&model(), "30", &["-c", "96"], input.as_bytes());
    assert_eq!(prompts.len(), 4, "{err}");
    assert!(err.contains("no room for a reply in the context of 96"), "{err}");
    assert!(err.contains("oldest 1 exchange(s) are forgotten"), "{err}");
    // Every turn's prompt left room for its reply.
    assert!(prompts.iter().all(|&p| p + 30 <= 96), "{prompts:?}");
    assert!(!err.contains("ContextFull"), "{err}");
}

#[test]
fn chat_keeps_the_conversation_in_one_session() {
    let (prompts, err) = chat(&model(), "6", b"What is 2+2?\n\nAnd 3+3?\n");
    // Two turns (the empty line is skipped); the first starts the conversation with BOS and
    // the user turn (p6: 16 tokens), the second appends only its own tokens.
    assert_eq!(prompts.len(), 2, "{err}");
    assert_eq!(prompts[0], 16, "{err}");
    assert!(prompts[1] < 20, "{err}");
}

#[test]
fn chat_renders_the_model_files_own_template() {
    use kiln_gguf::{GgufFile, GgufWriter, MetaValue};
    use kiln_tokenizer::Tokenizer;
    let run_chat = |path: &std::path::Path| {
        let out = kiln(&["run", "--model", path.to_str().unwrap(), "--chat", "--temperature", "0", "-n", "2", "hello there"]);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        (prompt_counts(&err), err)
    };
    let count = |path: &std::path::Path, text: &str| Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap().encode(text).len();

    // Files without a template: a Gemma gets Gemma's turns, any other architecture ChatML.
    let gemma = family_fixture("gemma3", "gguf");
    let (counts, err) = run_chat(&gemma);
    assert_eq!(counts, vec![count(&gemma, "<start_of_turn>user\nhello there<end_of_turn>\n<start_of_turn>model\n")], "{err}");
    let llama = family_fixture("llama", "gguf");
    let (counts, err) = run_chat(&llama);
    assert_eq!(counts, vec![count(&llama, "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n")], "{err}");

    // The llama fixture with a template of its own.
    const OWN: &str =
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}";
    let src = GgufFile::open(&llama).unwrap();
    let mut w = GgufWriter::new(3).unwrap();
    for (k, v) in src.metadata() {
        w.add_metadata(k.clone(), v.clone()).unwrap();
    }
    w.add_metadata("tokenizer.chat_template", MetaValue::String(OWN.into())).unwrap();
    for t in src.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.ty, src.tensor_data(t).to_vec()).unwrap();
    }
    let dir = std::env::temp_dir().join(format!("kiln-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("own.gguf");
    w.write(&path).unwrap();

    // `run --chat`: one user turn, as the template renders it.
    let first = "[user] hello there\n[assistant] ";
    let (counts, err) = run_chat(&path);
    assert_eq!(counts, vec![count(&path, first)], "{err}");

    // `chat`: the first turn whole, the second only what follows the cached reply.
    let (counts, err) = chat(&path, "3", b"hello there\nand again\n");
    assert_eq!(counts.len(), 2, "{err}");
    assert_eq!(counts[0], count(&path, first), "{err}");
    let whole_second = count(&path, "[user] hello there\n[assistant] x\n[user] and again\n[assistant] ");
    assert!(counts[1] < whole_second, "the second turn re-sent the conversation: {err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prompt_longer_than_context_is_a_clear_error() {
    let m = model();
    let long = "word ".repeat(100);
    let out = kiln(&["run", "--model", m.to_str().unwrap(), "-c", "32", &long]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("context"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn info_summarises_metadata_and_tensors() {
    let m = model();
    let out = stdout(&kiln(&["info", m.to_str().unwrap()]));
    assert!(out.contains("general.architecture = "), "{out}");
    assert!(out.contains("gemma3"));
    assert!(out.contains("tokenizer.ggml.tokens = "));
    for ty in ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"] {
        assert!(out.lines().any(|l| l.trim_start().starts_with(ty)), "no {ty} row in {out}");
    }
    assert!(out.contains("236"), "tensor count");
}

#[test]
fn malformed_file_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("kiln-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.gguf");
    std::fs::write(&bad, b"GGUF\x03\x00\x00\x00\xff").unwrap();
    for args in [vec!["info", bad.to_str().unwrap()], vec!["run", "--model", bad.to_str().unwrap(), "hi"]] {
        let out = kiln(&args);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("error:"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // A missing file names the file and says the cause once.
    let missing = dir.join("missing.gguf");
    let out = kiln(&["run", "--model", missing.to_str().unwrap(), "hi"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing.gguf") && err.starts_with("error:"), "{err}");
    assert_eq!(err.matches("os error").count(), 1, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn perplexity_matches_the_reference() {
    let m = model();
    let r = reference("p1");
    let dir = std::env::temp_dir().join(format!("kiln-ppl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("p1.txt");
    std::fs::write(&file, r["prompt"].as_str().unwrap()).unwrap();
    let out = stdout(&kiln(&["perplexity", "--model", m.to_str().unwrap(), "--file", file.to_str().unwrap(), "--json"]));
    let v: Value = serde_json::from_str(&out).unwrap();
    let want = r["nll_mean"].as_f64().unwrap();
    assert!((v["nll_mean"].as_f64().unwrap() - want).abs() < 1e-2, "{} vs {want}", v["nll_mean"]);
    let toks = v["tokens"].as_array().unwrap();
    let nll = r["per_token_nll"].as_array().unwrap();
    assert_eq!(toks.len(), nll.len());
    for (t, n) in toks.iter().zip(nll) {
        assert_eq!(t["id"], n["id"]);
        assert!((t["logprob"].as_f64().unwrap() - n["logprob"].as_f64().unwrap()).abs() < 1e-2);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The model-family fixtures of `kiln-models` (one tiny GGUF per supported architecture).
fn family_fixture(family: &str, ext: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tests/fixtures/families")).join(format!("{family}.{ext}"))
}

#[test]
fn info_and_greedy_run_work_on_every_family_fixture() {
    for family in ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma4"] {
        let path = family_fixture(family, "gguf");
        let path = path.to_str().unwrap();
        let info = stdout(&kiln(&["info", path]));
        assert!(info.contains(&format!("general.architecture = \"{family}\"")), "{family}: {info}");

        // The greedy continuation of the short case, up to its first near-tie (at most 8 tokens).
        let r: Value = serde_json::from_str(&std::fs::read_to_string(family_fixture(family, "json")).unwrap()).unwrap();
        let case = &r["cases"][0];
        let gaps = case["greedy_gaps"].as_array().unwrap();
        let n = gaps.iter().position(|g| g.as_f64().unwrap() < 1e-3).unwrap_or(gaps.len()).min(8);
        assert!(n >= 4, "{family}: near-tie at step {n}");
        let want: Vec<u32> = case["greedy_ids"].as_array().unwrap()[..n].iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let file = kiln_gguf::GgufFile::open(std::path::Path::new(path)).unwrap();
        let want_text = kiln_tokenizer::Tokenizer::from_gguf(&file).unwrap().decode(&want, true);
        let text = case["text"].as_str().unwrap();
        let out = stdout(&kiln(&["run", "--model", path, "--temperature", "0", "-n", &n.to_string(), text]));
        assert!(!want_text.trim().is_empty(), "{family}: the continuation decodes to nothing");
        assert_eq!(out.trim(), want_text.trim(), "{family}: greedy run");
    }
}

#[test]
fn bench_json_has_llama_bench_fields() {
    let m = model();
    let out = stdout(&kiln(&["bench", "-m", m.to_str().unwrap(), "-t", "2", "-p", "8", "-n", "3", "-r", "2", "-o", "json"]));
    let records: Value = serde_json::from_str(&out).expect("a JSON array");
    let records = records.as_array().expect("an array of records");
    assert_eq!(records.len(), 2);
    for (r, (n_prompt, n_gen)) in records.iter().zip([(8, 0), (0, 3)]) {
        assert_eq!((r["n_prompt"].as_u64(), r["n_gen"].as_u64()), (Some(n_prompt), Some(n_gen)), "{r}");
        assert_eq!(r["n_threads"], 2);
        assert_eq!(r["model_filename"], m.to_str().unwrap());
        assert!(r["model_type"].as_str().unwrap().starts_with("gemma3"), "{r}");
        assert!(r["model_size"].as_u64().unwrap() > 200_000_000 && r["model_n_params"].as_u64().unwrap() > 200_000_000);
        assert_eq!(r["samples_ns"].as_array().unwrap().len(), 2);
        assert_eq!(r["samples_ts"].as_array().unwrap().len(), 2);
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0 && r["stddev_ts"].as_f64().unwrap() >= 0.0);
        assert!(r["avg_ns"].as_u64().unwrap() > 0 && r["test_time"].as_str().unwrap().ends_with('Z'));
    }
}

#[test]
fn device_flag_is_checked() {
    let out = kiln(&["run", "--device", "gpu", "x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown device 'gpu'"));
    // Without the `cuda` feature (or without a GPU) asking for CUDA is a clear error, never a
    // silent fall-back to the CPU.
    let m = model();
    let out = kiln(&["run", "--model", m.to_str().unwrap(), "--device", "cuda:7", "-n", "1", "x"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("CUDA") || err.contains("cuda"), "{err}");
    // Only the CPU has the exact kernels: asking CUDA for them is an error on any machine.
    let out = kiln(&["run", "--model", m.to_str().unwrap(), "--device", "cuda", "--exact", "-n", "1", "x"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--exact") && err.contains("--device cpu") && !err.contains("panicked"), "{err}");
    // `cpu` and `auto` run (auto is the CPU on a machine without CUDA).
    for device in ["cpu", "auto"] {
        let out = kiln(&["run", "--model", m.to_str().unwrap(), "--device", device, "--temperature", "0", "-n", "2", "Hello"]);
        assert!(!stdout(&out).is_empty());
    }
}

#[test]
fn kv_type_flag_runs_an_f16_cache_and_rejects_what_it_cannot_do() {
    let m = model();
    let r = reference("p0");
    // Over an f16 cache the greedy continuation is the reference's up to its first near-tie too.
    let out =
        kiln(&["run", "--model", m.to_str().unwrap(), "--kv-type", "f16", "--temperature", "0", "-n", "11", r["prompt"].as_str().unwrap()]);
    let pieces: Vec<&str> = r["greedy"]["pieces"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    assert_eq!(stdout(&out).trim_end_matches('\n'), pieces[..11].concat().replace('\u{2581}', " "));
    let out = stdout(&kiln(&["bench", "-m", m.to_str().unwrap(), "--kv-type", "f16", "-p", "8", "-n", "2", "-r", "1", "-o", "json"]));
    let records: Value = serde_json::from_str(&out).expect("a JSON array");
    assert!(records.as_array().unwrap().iter().all(|r| r["type_k"] == "f16" && r["type_v"] == "f16"), "{records}");
    for (args, needle) in [(&["--kv-type", "q8"][..], "unknown KV cache type 'q8'"), (&["--kv-type", "f16", "--exact"][..], "--exact")] {
        let mut all = vec!["run", "--model", m.to_str().unwrap(), "-n", "1"];
        all.extend_from_slice(args);
        all.push("x");
        let out = kiln(&all);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn bench_prints_a_table_and_runs_the_exact_kernels_on_request() {
    let m = model();
    let out = stdout(&kiln(&["bench", "-m", m.to_str().unwrap(), "--exact", "-p", "4,6", "-n", "2", "-s", "1,3", "-r", "1"]));
    assert!(out.starts_with("| model |"), "{out}");
    for test in ["| pp4 |", "| pp6 |", "| tg2 |", "| tg2 x3 |"] {
        assert!(out.contains(test), "{test} missing: {out}");
    }
    assert!(out.contains("Exact kernels"), "{out}");
}

#[test]
fn bench_rejects_bad_arguments_clearly() {
    let m = model();
    for (args, needle) in [
        (&["-r", "0"][..], "repetitions"),
        (&["-p", "0", "-n", "0"][..], "nothing to measure"),
        (&["-p", "100", "-n", "0", "-c", "50"][..], "context"),
        (&["-o", "xml"][..], "xml"),
        (&["-s", "0"][..], "seqs"),
    ] {
        let mut all = vec!["bench", "-m", m.to_str().unwrap()];
        all.extend_from_slice(args);
        let out = kiln(&all);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn synth_writes_a_model_kiln_can_read() {
    let path = std::env::temp_dir().join(format!("kiln-cli-synth-{}.gguf", std::process::id()));
    let p = path.to_str().unwrap();
    stdout(&kiln(&["synth", "--preset", "270m", "--seed", "3", "-o", p]));
    let info = stdout(&kiln(&["info", p]));
    assert!(info.contains("gemma3") && info.contains("Q4_K") && info.contains("Q8_0"), "{info}");
    std::fs::remove_file(&path).unwrap();
    let out = kiln(&["synth", "--preset", "3b", "-o", p]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown preset '3b'"));
    let out = kiln(&["synth", "--formats", "q9_9", "-o", p]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown formats 'q9_9'"));
}
