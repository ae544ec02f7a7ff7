// charrun --serve: the page's behaviour. It reads the engine from /status, sends the image,
// speech and prompt with a WebRTC offer, plays what comes back, and shows what the server
// pushes over the "events" data channel: its live numbers (each second), the session's
// state, and errors. Every failure it can meet is said as a sentence with what to do.
"use strict";

const $ = (id) => document.getElementById(id);

const STALE_MS = 4000;  // no word from the server for this long while streaming: it is gone
const CONNECT_MS = 15000;  // Start pressed and no frame by then: no path between the two
// the chart, drawn in the SVG's own pixels: margins for the labels, and the minute it spans
const CHART = { left: 48, right: 10, top: 14, bottom: 26, span_s: 60 };
const SMALL_FRAME_PX = 256;  // frames below this are enlarged with crisp pixels
const MEGABYTE = 1024 * 1024;

const STATE_TEXT = {
  loading: ["Loading", "Reading which engine is loaded…"],
  ready: ["Ready", "Choose a face image and speech (a file or the microphone), then press " +
                   "Start."],
  busy: ["Busy", "Every session this server runs is in progress: wait for one to end, " +
                 "then press Start."],
  connecting: ["Connecting", "Starting a session: sending the image and speech, waiting for " +
                             "the first frames…"],
  starting: ["Connecting", "The session is starting: the first frames are on their way…"],
  speaking: ["Speaking", "The character is saying the speech. Interrupt cuts it off."],
  listening: ["Listening", "The speech has played; the character listens between turns. " +
                           "Press Stop to end, then Start with new speech."],
  interrupted: ["Interrupted", "The rest of the speech was dropped; the character listens. " +
                               "Press Stop to end, then Start with new speech."],
  ended: ["Ended", "The session ended. Press Start to begin a new one."],
  error: ["Error", ""],
};

// what to do after an HTTP error, by what was asked and the status
const WHAT_TO_DO = {
  start: {
    400: "Check the image and speech you chose, then press Start again.",
    413: "Choose smaller files, then press Start again.",
    500: "The server failed: charrun's log has the cause. Press Start to try again.",
    503: "Wait a moment, then press Start again.",
  },
  interrupt: { 404: "The session had already ended: press Start to begin a new one." },
  stop: {},
  status: {},
};

const page = {
  engine: null,       // /status's "engine"
  pc: null,
  events: null,
  session: null,      // the session's id from /offer: its capability
  active: false,      // a session is open (from Start until it ends)
  errored: false,     // this session ended in an error: keep its sentence
  lastStats: 0,       // when the last live numbers arrived (performance.now())
  image: null,        // { file, img, ok }
  mic: null,          // { stream, ctx, analyser, data }
  micOpening: null,   // the microphone's getUserMedia, while it is asked for
  connectingSince: 0, // when Start was pressed (performance.now())
  lastSteps: [],      // the chart's last [seconds ago, step seconds]
  usingMic: false,    // the session's speech is the microphone's
  interrupting: false, // Interrupt pressed, the server's own "interrupted" not yet heard:
                       // a state it sent before the barge-in does not undo the page's
  state: "loading",
};

// ---- states and sentences --------------------------------------------------------------
const LISTENING_TO_MIC = "The character listens: speak into the microphone and it speaks " +
                         "your words.";

function setState(state, said) {
  page.state = state;
  const [label, stateText] = STATE_TEXT[state] || [state, ""];
  const text = state === "listening" && page.usingMic ? LISTENING_TO_MIC : stateText;
  $("state").textContent = label;
  $("state").dataset.state = state;
  if (state !== "error") say(said ?? text, false);
  $("screen").classList.toggle("live", ["starting", "speaking", "listening",
                                        "interrupted"].includes(state));
}

function say(text, isError) {
  $("message").textContent = text;
  $("message").className = isError ? "message error" : "message";
}

function fail(sentence) {
  setState("error");
  say(sentence, true);
}

function sentence(text) {  // a reason as the end of a sentence: no doubled stop
  return String(text).trim().replace(/[.\s]+$/, "");
}

function whatToDo(action, status) {
  const todo = (WHAT_TO_DO[action] || {})[status];
  if (todo) return todo;
  if (status === 404 || status === 405) return "The page and the server do not match: reload " +
                                                "the page.";
  if (status >= 500) return "The server (or a proxy in front of it) failed: wait a moment, " +
                            "then try again; charrun's log has the cause.";
  return "Reload the page and try again.";
}

// An HTTP error as a sentence: the server's own words where it gave JSON, else the status.
async function explain(res, action, what) {
  const body = await res.text().catch(() => "");
  let reason = null;
  try {
    reason = JSON.parse(body).error;
  } catch (e) {
    reason = null;
  }
  if (!reason) {
    const title = /<title>([^<]*)<\/title>/i.exec(body);
    reason = `the server answered ${res.status} ${res.statusText || ""}`.trim() +
             (title ? ` ("${title[1].trim()}")` : "") + " without saying why";
  }
  return `${what}: ${sentence(reason)}. ${whatToDo(action, res.status)}`;
}

function unreachable(what, err) {
  return `${what}: the server could not be reached (${sentence(err.message || err)}). Check ` +
         `that charrun is still running at ${location.origin}, then reload the page.`;
}

async function request(path, action, what, options = {}) {
  let res;
  try {
    res = await fetch(path, options);
  } catch (err) {
    return { error: unreachable(what, err) };
  }
  if (!res.ok) return { error: await explain(res, action, what) };
  try {
    return { body: await res.json() };
  } catch (err) {
    return { error: `${what}: the server's answer was not JSON (${res.status}). ` +
                    whatToDo(action, 500) };
  }
}

// ---- the engine ------------------------------------------------------------------------
async function loadStatus() {
  const got = await request("/status", "status", "Could not read the engine");
  if (got.error) {
    fail(got.error);
    return;
  }
  const s = got.body, e = s.engine;
  page.engine = e;
  const unit = e.unit === "chunk" ? `chunks of ${e.frames_per_step} frames`
                                  : `steps of ${e.frames_per_step} frames`;
  const where = e.device === "cuda" ? `${e.gpu || "GPU"}${e.tp > 1 ? ` × ${e.tp}` : ""}`
                                    : `CPU${e.tp > 1 ? `, TP-${e.tp}` : ""}`;
  $("engine").innerHTML = "";
  for (const [k, v] of [["family", e.family], ["preset", e.preset], ["target", e.target],
                        ["fps", `${e.fps} fps`], ["frame", `${e.width} × ${e.height}`],
                        ["unit", unit], ["device", where]]) {
    const b = document.createElement("b");
    b.textContent = v;
    b.dataset.field = k;
    $("engine").append(b, " · ");
  }
  $("engine").lastChild.remove();
  document.documentElement.style.setProperty("--aspect", `${e.width} / ${e.height}`);
  $("screen").classList.toggle("small", Math.max(e.width, e.height) < SMALL_FRAME_PX);
  $("poster").width = $("thumb").width = Math.round(96 * Math.min(1, e.width / e.height));
  $("poster").height = $("thumb").height = Math.round(96 * Math.min(1, e.height / e.width));
  $("n-step-label").textContent = e.unit === "chunk" ? "Chunk time" : "Step time";
  $("chart").setAttribute("aria-label", `${e.unit} time over the last minute`);
  $("chart-caption").textContent = `${e.unit === "chunk" ? "Chunk" : "Step"} time over the ` +
    `last minute; dashed: the real-time budget, ${ms(e.budget_s)} for ${e.frames_per_step} ` +
    `frames at ${e.fps} fps.`;
  page.maxUpload = s.max_upload_bytes;
  drawChart([], e.budget_s);
  drawThumb();
  if (!page.active && ["loading", "ready", "busy"].includes(page.state)) {
    setState(s.active >= s.capacity ? "busy" : "ready");
  }
  updateButtons();
}

// ---- the image: a thumbnail fitted as the server will fit it ---------------------------
function chooseImage() {
  const file = $("image").files[0];
  page.image = null;
  if (!file) {
    $("image-note").textContent = "No image chosen: the character starts from grey.";
    $("image-note").className = "note";
    drawThumb();
    updateButtons();
    return;
  }
  const img = new Image();
  const url = URL.createObjectURL(file);
  img.onload = () => {
    page.image = { file, img, ok: true };
    $("image-note").className = "note";
    fitNote();
    drawThumb();
    if (page.state === "error") setState(page.active ? page.state : "ready");
    updateButtons();
  };
  img.onerror = () => {
    URL.revokeObjectURL(url);
    page.image = { file, img: null, ok: false };
    const why = `"${file.name}" is not an image this browser can read. Choose a PNG, JPEG ` +
                "or WebP picture of a face.";
    $("image-note").textContent = why;
    $("image-note").className = "note bad";
    drawThumb();
    if (!page.active) fail(why);
    updateButtons();
  };
  img.src = url;
}

function fitNote() {
  const im = page.image, e = page.engine;
  if (!im || !im.ok || !e) return;
  const how = { cover: "scaled to cover it, centre-cropped",
                contain: "scaled to fit inside it, the margins filled",
                stretch: "stretched to its shape" }[$("fit").value];
  $("image-note").textContent = `${im.img.naturalWidth} × ${im.img.naturalHeight} ` +
    `${im.file.name}: ${how} (the model's frame is ${e.width} × ${e.height}).`;
}

function drawFitted(canvas, img) {
  const g = canvas.getContext("2d"), W = canvas.width, H = canvas.height;
  g.clearRect(0, 0, W, H);
  if (!img) {
    g.fillStyle = "#808080";
    g.fillRect(0, 0, W, H);
    return;
  }
  const fit = $("fit").value, iw = img.naturalWidth, ih = img.naturalHeight;
  g.fillStyle = $("background").value;
  g.fillRect(0, 0, W, H);
  if (fit === "stretch") {
    g.drawImage(img, 0, 0, W, H);
    return;
  }
  const s = (fit === "cover" ? Math.max : Math.min)(W / iw, H / ih);
  g.drawImage(img, (W - iw * s) / 2, (H - ih * s) / 2, iw * s, ih * s);
}

function drawThumb() {
  const img = page.image && page.image.ok ? page.image.img : null;
  drawFitted($("thumb"), img);
  drawFitted($("poster"), img);
  $("placeholder").textContent = img ? "Press Start to bring the character to life."
                                     : "Choose a face image, then press Start.";
}

// ---- the speech: a file, or the microphone with a level meter --------------------------
function chooseSpeech() {
  const file = $("speech").files[0];
  if (!file) {
    $("speech-note").textContent = "No speech chosen: the character listens.";
    return;
  }
  $("from-file").checked = true;
  closeMic();
  $("speech-note").textContent = `${file.name} (${(file.size / 1024).toFixed(0)} kB)`;
  const probe = new Audio();
  probe.preload = "metadata";
  probe.onloadedmetadata = () => {
    if (isFinite(probe.duration)) {
      $("speech-note").textContent = `${file.name}: ${probe.duration.toFixed(1)} s`;
    }
    URL.revokeObjectURL(probe.src);
  };
  probe.onerror = () => URL.revokeObjectURL(probe.src);  // the server reads more formats
  probe.src = URL.createObjectURL(file);
}

function chooseSource() {
  if (!$("mic").checked) {
    closeMic();
    return;
  }
  page.micOpening = openMic().finally(() => { page.micOpening = null; });
}

async function openMic() {
  if (page.mic) return;
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const ctx = new AudioContext();
    const analyser = ctx.createAnalyser();
    analyser.fftSize = 1024;
    ctx.createMediaStreamSource(stream).connect(analyser);
    page.mic = { stream, ctx, analyser, data: new Float32Array(analyser.fftSize) };
    $("level-note").textContent = "on";
    meter();
  } catch (err) {
    $("from-file").checked = true;
    fail(`The microphone could not be opened (${sentence(err.name || err.message)}). Allow ` +
         "it in the browser's site settings, or choose a speech file.");
  }
  updateButtons();
}

function closeMic() {
  if (!page.mic) return;
  page.mic.stream.getTracks().forEach((t) => t.stop());
  page.mic.ctx.close();
  page.mic = null;
  $("level").value = 0;
  $("level-note").textContent = "off";
}

function meter() {
  const m = page.mic;
  if (!m) return;
  m.analyser.getFloatTimeDomainData(m.data);
  let sum = 0;
  for (const v of m.data) sum += v * v;
  $("level").value = Math.min(1, 3 * Math.sqrt(sum / m.data.length));
  requestAnimationFrame(meter);
}

// ---- a session -------------------------------------------------------------------------
function readDataUrl(file) {
  if (!file) return Promise.resolve(null);
  return new Promise((ok, no) => {
    const r = new FileReader();
    r.onload = () => ok(r.result);
    r.onerror = () => no(r.error);
    r.readAsDataURL(file);
  });
}

function iceGathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((ok) => pc.addEventListener("icegatheringstatechange", () => {
    if (pc.iceGatheringState === "complete") ok();
  }));
}

function updateButtons() {
  const ready = page.engine && !page.active && !(page.image && !page.image.ok);
  $("start").disabled = !ready;
  $("interrupt").disabled = $("stop").disabled = !page.active;
}

async function start() {
  const imageFile = page.image && page.image.ok ? page.image.file : null;
  const speechFile = $("mic").checked ? null : $("speech").files[0] || null;
  const size = (imageFile ? imageFile.size : 0) + (speechFile ? speechFile.size : 0);
  if (page.maxUpload && size * 4 / 3 > page.maxUpload) {
    fail(`Could not start: the image and speech come to ${(size / MEGABYTE).toFixed(0)} MB; ` +
         `the server takes at most ${(page.maxUpload * 3 / 4 / MEGABYTE).toFixed(0)} MB. ` +
         "Choose smaller files, then press Start again.");
    return;
  }
  page.active = true;
  page.errored = false;
  page.interrupting = false;
  page.connectingSince = performance.now();
  updateButtons();
  setState("connecting");
  if (page.micOpening) await page.micOpening;
  clearNumbers();
  const pc = page.pc = new RTCPeerConnection({ iceServers: [] });  // loopback and LAN only
  const media = new MediaStream();
  pc.ontrack = (ev) => {
    media.addTrack(ev.track);
    $("video").srcObject = media;
  };
  pc.onconnectionstatechange = () => connectionChanged(pc);
  const events = page.events = pc.createDataChannel("events");  // the server's word
  // the server sends the session's events once the channel has said the session's id
  events.onopen = () => events.send(JSON.stringify({ type: "hello", session: page.session }));
  events.onmessage = (ev) => serverSaid(pc, JSON.parse(ev.data));
  events.onclose = () => {
    if (page.pc === pc && page.active) dropped("the server closed the session's channel");
  };
  pc.addTransceiver("video", { direction: "recvonly" });
  const mic = $("mic").checked && page.mic;
  page.usingMic = Boolean(mic);
  if (mic) {
    pc.addTransceiver(page.mic.stream.getAudioTracks()[0], { direction: "sendrecv" });
  } else {
    pc.addTransceiver("audio", { direction: "recvonly" });
  }
  let body;
  try {
    await pc.setLocalDescription(await pc.createOffer());
    await iceGathered(pc);
    body = {
      sdp: pc.localDescription.sdp, type: pc.localDescription.type, mic: Boolean(mic),
      image: await readDataUrl(imageFile), image_name: imageFile ? imageFile.name : null,
      speech: await readDataUrl(speechFile), speech_name: speechFile ? speechFile.name : null,
      prompt: $("prompt").value, fit: $("fit").value, background: $("background").value,
    };
  } catch (err) {
    end();
    fail(`Could not start: this browser could not prepare the session (${sentence(err)}). ` +
         "Reload the page and try again.");
    return;
  }
  const got = await request("/offer", "start", "Could not start", {
    method: "POST", body: JSON.stringify(body), headers: { "Content-Type": "application/json" },
  });
  if (page.pc !== pc) return;  // stopped meanwhile
  if (got.error) {
    end();
    fail(got.error);
    return;
  }
  page.session = got.body.session;  // what /interrupt, /stop and the events channel ask for
  try {
    await pc.setRemoteDescription(got.body);
  } catch (err) {
    end();
    fail(`Could not start: the server's answer could not be used (${sentence(err)}). ` +
         "Reload the page and try again.");
    return;
  }
  const notes = got.body.notes || [];
  for (const n of notes) {
    if (n.startsWith("image: ")) $("image-note").textContent = `Sent: ${n.slice(7)}.`;
    else if (n.startsWith("speech: ")) $("speech-note").textContent = `Sent: ${n.slice(8)}.`;
  }
  page.lastStats = performance.now();
}

function serverSaid(pc, e) {
  if (page.pc !== pc) return;
  if (e.type === "stats") {
    page.lastStats = performance.now();
    showNumbers(e);
    if (e.state && !page.errored) showSessionState(e.state);
  } else if (e.type === "state") {
    if (!page.errored) showSessionState(e.state);
  } else if (e.type === "error") {
    page.errored = true;
    end();
    fail(`The session stopped: ${sentence(e.message)}. Press Start to begin a new one.`);
  } else if (e.type === "draining") {
    say(`${sentence(e.message)}. Press Start again once the server is back.`, false);
  } else if (e.type === "ended") {
    end();
    if (!page.errored) {
      setState("ended", e.why ? `The session ended: ${sentence(e.why)}. Press Start to begin ` +
                                "a new one." : undefined);
    }
  }
}

function showSessionState(state) {
  if (state === "ended") return;  // the "ended" event closes the session
  if (page.interrupting) {
    if (state !== "interrupted") return;  // sent before the server took the barge-in
    page.interrupting = false;
  }
  if (state !== page.state) setState(state);
}

function connectionChanged(pc) {
  if (page.pc !== pc || !page.active) return;
  if (pc.connectionState === "failed") {
    dropped("the WebRTC connection failed");
  } else if (pc.connectionState === "disconnected") {
    say("The connection is unsteady: waiting for it to recover…", false);
  }
}

function dropped(why) {
  page.errored = true;
  end();
  fail(`The connection to the server was lost (${why}). Check that charrun is still running ` +
       "and reachable. Press Start to begin a new session.");
}

function watchdog() {
  if (page.active && ["connecting", "starting"].includes(page.state) && page.pc &&
      performance.now() - page.connectingSince > CONNECT_MS) {
    page.errored = true;
    end();
    fail(`No video arrived within ${CONNECT_MS / 1000} s of Start: the browser and the ` +
         "server found no network path to each other (charrun uses no STUN server unless " +
         "given --ice-server). Open the page from an address both can reach, then press " +
         "Start.");
    return;
  }
  if (page.active && !["connecting", "starting"].includes(page.state) && page.pc &&
      performance.now() - page.lastStats > STALE_MS) {
    dropped(`no word from it for ${STALE_MS / 1000} s`);
  }
  if (page.lastStats && page.active) {
    const age = (performance.now() - page.lastStats) / 1000;
    $("numbers-age").textContent = age < 2 ? "· live" : `· ${age.toFixed(0)} s old`;
  } else {
    $("numbers-age").textContent = "";
  }
}

function end() {
  const pc = page.pc;
  page.pc = page.events = null;
  page.active = false;
  if (pc) pc.close();
  $("video").srcObject = null;
  updateButtons();
}

// A control request for this page's session: JSON naming it by the id /offer gave.
function sessionRequest() {
  return { method: "POST", body: JSON.stringify({ session: page.session }),
           headers: { "Content-Type": "application/json" } };
}

async function interrupt() {
  page.interrupting = true;
  const got = await request("/interrupt", "interrupt", "Could not interrupt",
                            sessionRequest());
  if (got.error) {
    page.interrupting = false;
    fail(got.error);
    return;
  }
  if (page.active && page.interrupting) setState("interrupted");
}

async function stop() {
  const got = await request("/stop", "stop", "Could not stop cleanly", sessionRequest());
  end();
  if (got.error) fail(got.error);
  else if (!page.errored) setState("ended");
  loadStatus();
}

// ---- the live numbers ------------------------------------------------------------------
function ms(s) {
  if (s === null || s === undefined) return "–";
  const v = s * 1000;
  return v < 10 ? `${v.toFixed(1)} ms` : `${v.toFixed(0)} ms`;
}

function put(id, html, values = {}, tone = "") {
  const dd = $(id);
  dd.innerHTML = html;
  dd.className = tone;
  for (const [k, v] of Object.entries(values)) dd.dataset[k] = v === null ? "" : String(v);
}

function clearNumbers() {
  for (const id of ["n-generation", "n-playback", "n-step", "n-queue", "n-latency", "n-drift",
                    "n-stalls"]) {
    put(id, "–");
    for (const k of Object.keys($(id).dataset)) delete $(id).dataset[k];
  }
  page.lastSteps = [];
  if (page.engine) drawChart([], page.engine.budget_s);
}

function showNumbers(n) {
  const e = page.engine || { unit: "step", slack: 0, budget_s: 0 };
  const unit = e.unit;
  const gen = n.generation_fps, rt = n.realtime_factor;
  put("n-generation", gen === null ? "–" :
      `${gen.toFixed(gen < 100 ? 1 : 0)} fps <small>${rt.toFixed(1)}× real time</small>`,
      { value: gen, realtime: rt }, rt === null ? "" : rt >= 1 ? "good" : "bad");
  const fps = n.playback_fps;
  put("n-playback", fps === null ? "–" : `${fps.toFixed(1)} fps <small>of ${n.target_fps}` +
      "</small>", { value: fps },
      fps === null ? "" : fps >= 0.97 * n.target_fps ? "good" : "warn");
  const st = n.step_s;
  put("n-step", st["0.5"] === null ? "–" : `${ms(st["0.5"])} <small>median · p90 ` +
      `${ms(st["0.9"])}</small>`, { p50: st["0.5"], p90: st["0.9"], last: st.last },
      st["0.9"] === null ? "" : st["0.9"] <= e.budget_s ? "good" : "bad");
  put("n-queue", `${n.queued_steps} of ${e.slack} ${unit}s <small>· ${n.queued_frames} ` +
      "frames</small>", { steps: n.queued_steps, frames: n.queued_frames });
  const lat = n.latency_s;
  put("n-latency", lat.last === null ? "– <small>no speech yet</small>" :
      `${ms(lat.last)} <small>median ${ms(lat["0.5"])}</small>`,
      { value: lat.last, p50: lat["0.5"] });
  const dr = n.drift_s;
  put("n-drift", dr["0.9"] === null ? "–" : `${ms(dr["0.9"])} <small>p90 · max ` +
      `${ms(dr["1.0"])}</small>`, { p90: dr["0.9"], max: dr["1.0"] });
  put("n-stalls", n.stalls ? `${n.stalls} <small>· ${ms(n.stall_s)} held</small>` : "0",
      { value: n.stalls }, n.stalls ? "warn" : "good");
  page.lastSteps = n.steps;
  drawChart(n.steps, e.budget_s);
}

function place(id, attrs) {
  for (const [k, v] of Object.entries(attrs)) $(id).setAttribute(k, v.toFixed ? v.toFixed(1) : v);
}

function drawChart(steps, budget) {
  const chart = $("chart");
  const W = chart.clientWidth || 600, H = chart.clientHeight || 170;
  chart.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const left = CHART.left, right = W - CHART.right, top = CHART.top, bottom = H - CHART.bottom;
  const peak = Math.max(budget * 1.5, ...steps.map(([, s]) => s * 1.1));
  const y = (s) => bottom - (bottom - top) * Math.min(1, s / peak);
  const x = (age) => right - (right - left) * Math.min(1, age / CHART.span_s);
  const points = steps.slice().reverse().map(([age, s]) => `${x(age).toFixed(1)},` +
                                                           `${y(s).toFixed(1)}`);
  $("chart-steps").setAttribute("points", points.join(" "));
  place("chart-axis", { x1: left, x2: right, y1: bottom, y2: bottom });
  place("chart-budget", { x1: left, x2: right, y1: y(budget), y2: y(budget) });
  place("chart-budget-label", { x: left + 4, y: y(budget) - 5 });
  place("chart-top", { x: left - 6, y: top + 4 });
  place("chart-zero", { x: left - 6, y: bottom + 4 });
  place("chart-old", { x: left, y: H - 8 });
  place("chart-now", { x: right, y: H - 8 });
  $("chart-budget-label").textContent = budget ? `real-time budget ${ms(budget)}` : "";
  $("chart-top").textContent = budget ? ms(peak) : "";
  chart.dataset.points = String(points.length);
  chart.dataset.updates = String(Number(chart.dataset.updates) + 1);
}

// What arrived, from getStats() (the browser's own count of frames and samples).
window.charStats = async () => {
  const pc = page.pc;
  const out = { video: null, audio: null, state: pc ? pc.connectionState : "none" };
  if (!pc) return out;
  (await pc.getStats()).forEach((r) => {
    if (r.type !== "inbound-rtp") return;
    if (r.kind === "video") out.video = { framesDecoded: r.framesDecoded,
      framesReceived: r.framesReceived, framesPerSecond: r.framesPerSecond,
      framesDropped: r.framesDropped, frameWidth: r.frameWidth };
    if (r.kind === "audio") out.audio = { totalSamplesReceived: r.totalSamplesReceived,
      concealedSamples: r.concealedSamples, concealmentEvents: r.concealmentEvents,
      packetsReceived: r.packetsReceived };
  });
  return out;
};

$("start").onclick = start;
$("interrupt").onclick = interrupt;
$("stop").onclick = stop;
$("image").onchange = chooseImage;
$("speech").onchange = chooseSpeech;
$("fit").onchange = $("background").oninput = () => {
  fitNote();
  drawThumb();
};
$("mic").onchange = $("from-file").onchange = chooseSource;
window.addEventListener("resize", () => {
  if (page.engine) drawChart(page.lastSteps, page.engine.budget_s);
});
setInterval(watchdog, 1000);
setState("loading");
loadStatus();
