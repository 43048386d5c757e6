"""The page `serve` shows: choose or drop an image, see the class, the probabilities, the overlay or the refusal.

Three fixed texts (no templates, nothing from the request in them); the script
writes every answer with textContent, so a file name or message can never
become markup. The Content-Security-Policy (covidxray/serve/app.py) lets only
these files run.
"""

INDEX = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>covidxray: classify a chest X-ray</title>
<link rel="stylesheet" href="/app.css">
<script src="/app.js" defer></script>
</head>
<body>
<main>
<h1>Classify a chest X-ray</h1>
<p class="notice" id="notice">Not a diagnosis. This is a research model's output, for a clinician to weigh with the
patient, never instead of one. The image is classified on this server and sent nowhere else.</p>
<form id="form">
<label id="drop" for="file">Choose or drop a PNG, JPEG or DICOM image
<input type="file" id="file" name="file" accept=".png,.jpg,.jpeg,.dcm,.dicom,image/png,image/jpeg,application/dicom">
</label>
<button type="submit" id="send">Classify</button>
</form>
<p id="status" role="status"></p>
<section id="result" hidden>
<h2><span id="file-name"></span>: <span id="label"></span></h2>
<table id="probabilities"><thead><tr><th>class</th><th>probability (calibrated)</th></tr></thead><tbody></tbody></table>
<p id="overlay-note"></p>
<figure id="overlay-figure" hidden><img id="overlay" alt="Grad-CAM overlay: where the model looked">
<figcaption>Grad-CAM: red is where the evidence for this class lies. It shows what the model used, which may be
an artefact rather than the lungs.</figcaption></figure>
</section>
<section id="refusal" hidden>
<h2>Not classified</h2>
<p id="rejected"></p>
</section>
<p id="error" role="alert" hidden></p>
</main>
</body>
</html>
"""

SCRIPT = r"""'use strict';
(() => {
  const $ = (id) => document.getElementById(id);
  const show = (id, visible) => { $(id).hidden = !visible; };

  function clear() {
    ['result', 'refusal', 'error', 'overlay-figure'].forEach((id) => show(id, false));
    $('probabilities').tBodies[0].replaceChildren();
    $('overlay').removeAttribute('src');
    $('overlay-note').textContent = '';
  }

  function render(answer) {
    if (answer.label !== undefined) {
      $('file-name').textContent = answer.file;
      $('label').textContent = answer.label;
      const body = $('probabilities').tBodies[0];
      for (const [name, p] of Object.entries(answer.probabilities)) {
        const row = body.insertRow();
        row.insertCell().textContent = name;
        row.insertCell().textContent = (100 * p).toFixed(1) + ' %';
      }
      if (answer.gradcam) {
        $('overlay').src = answer.gradcam;
        show('overlay-figure', true);
      } else if (answer.gradcam_unavailable) {
        $('overlay-note').textContent = 'No overlay: ' + answer.gradcam_unavailable;
      }
      if (answer.source_profile && answer.source_profile.warning) {
        $('overlay-note').textContent += ' Warning: ' + answer.source_profile.warning;
      }
      show('result', true);
    } else if (answer.rejected !== undefined) {
      $('rejected').textContent = answer.file + ': ' + answer.rejected + ' (' + answer.reason + ', score '
        + Number(answer.score).toPrecision(3) + ', limit ' + Number(answer.limit).toPrecision(3) + ')';
      show('refusal', true);
    } else {
      $('error').textContent = (answer.file ? answer.file + ': ' : '') + (answer.error || 'no answer');
      show('error', true);
    }
  }

  async function send(file) {
    clear();
    $('status').textContent = 'classifying ' + file.name + ' ...';
    const form = new FormData();
    form.append('file', file, file.name);
    try {
      const response = await fetch('/predict?overlay=1', { method: 'POST', body: form, credentials: 'same-origin' });
      let answer;
      try { answer = await response.json(); } catch (e) { answer = { error: 'HTTP ' + response.status }; }
      render(answer);
      $('status').textContent = 'done';
    } catch (e) {
      $('error').textContent = 'the server could not be reached (' + e + ')';
      show('error', true);
      $('status').textContent = '';
    }
  }

  document.addEventListener('DOMContentLoaded', () => {
    $('form').addEventListener('submit', (event) => {
      event.preventDefault();
      const file = $('file').files[0];
      if (file) { send(file); } else { $('status').textContent = 'choose an image first'; }
    });
    $('file').addEventListener('change', () => { if ($('file').files[0]) { send($('file').files[0]); } });
    const drop = $('drop');
    drop.addEventListener('dragover', (event) => { event.preventDefault(); drop.classList.add('over'); });
    drop.addEventListener('dragleave', () => drop.classList.remove('over'));
    drop.addEventListener('drop', (event) => {
      event.preventDefault();
      drop.classList.remove('over');
      if (event.dataTransfer.files[0]) { send(event.dataTransfer.files[0]); }
    });
  });
})();
"""

STYLE = """body { font-family: system-ui, sans-serif; margin: 0; background: #f6f6f4; color: #1b1b1b; }
main { max-width: 52rem; margin: 0 auto; padding: 1rem; }
.notice { background: #fff4d6; border-left: 4px solid #d89b00; padding: 0.6rem 0.8rem; }
#drop { display: block; border: 2px dashed #888; border-radius: 8px; padding: 1.5rem; margin: 1rem 0; }
#drop.over { border-color: #0a6; background: #eefaf3; }
#drop input { display: block; margin-top: 0.6rem; }
button { font-size: 1rem; padding: 0.4rem 1.2rem; }
table { border-collapse: collapse; margin: 0.6rem 0; }
td, th { border-bottom: 1px solid #ccc; padding: 0.2rem 0.8rem; text-align: left; }
#overlay { max-width: 100%; height: auto; }
#error { color: #a00; font-weight: bold; }
#rejected { color: #7a3e00; }
"""
