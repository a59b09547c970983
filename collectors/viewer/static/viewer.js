// trajstore view: the token view of an episode, fetched on demand (no libraries, no network beyond this server).
"use strict";

// Behaviour logprob -> a background from red (unlikely, p -> 0) to green (p -> 1), through yellow.
function logprobColor(lp) {
  const p = Math.exp(Math.max(lp, -20));
  return `hsl(${Math.round(120 * p)}, 75%, ${Math.round(82 - 12 * p)}%)`;
}

function shown(text) {
  if (text === null || text === undefined) return null;
  return text.replace(/\n/g, "⏎").replace(/\t/g, "⇥").replace(/ /g, "·");
}

function tokenChip(tok, observation) {
  const chip = document.createElement("span");
  const kind = tok.kind === "prompt" ? (observation ? "observation" : "prompt")
    : tok.kind === "sampled" ? "sampled" : "masked";
  chip.className = `tok tok-${kind}`;
  chip.dataset.id = tok.id;
  chip.dataset.kind = tok.kind;
  if (tok.logprob !== null) {
    chip.dataset.logprob = tok.logprob;
    chip.style.background = logprobColor(tok.logprob);
  }
  const text = document.createElement("b");
  text.textContent = shown(tok.text) ?? "";
  const meta = document.createElement("small");
  meta.textContent = tok.logprob === null ? `${tok.id}` : `${tok.id} · ${tok.logprob.toFixed(3)}`;
  chip.append(text, meta);
  const parts = [`id ${tok.id}`, kind === "masked" ? "sampled, masked out of the loss" : kind];
  if (tok.logprob !== null) parts.push(`logprob ${tok.logprob.toFixed(4)} (p ${Math.exp(tok.logprob).toFixed(3)})`);
  chip.title = parts.join(" · ");
  return chip;
}

async function toggleTokens(button) {
  const on = button.getAttribute("aria-pressed") !== "true";
  if (on && !button.dataset.loaded) {
    button.disabled = true;
    button.textContent = "loading tokens…";
    try {
      const reply = await fetch(button.dataset.url);
      const body = await reply.json();
      if (!reply.ok) throw new Error(body.error ? body.error.message : reply.statusText);
      for (const turn of body.turns) {
        const el = document.querySelector(
          `article.turn[data-segment="${CSS.escape(turn.segment_id)}"][data-turn="${turn.turn_index}"]`);
        if (!el) continue;
        const box = el.querySelector(".tokens");
        const observation = el.dataset.observation === "1";
        box.replaceChildren(...turn.tokens.map((t) => tokenChip(t, observation)));
      }
      button.dataset.loaded = "1";
    } catch (err) {
      button.disabled = false;
      button.textContent = "token view";
      const note = document.createElement("p");
      note.className = "error";
      note.id = "token-error";
      note.textContent = `could not load the tokens: ${err.message}`;
      button.after(note);
      return;
    }
    button.disabled = false;
  }
  button.setAttribute("aria-pressed", on ? "true" : "false");
  button.textContent = on ? "text view" : "token view";
  document.body.classList.toggle("token-mode", on);
  for (const box of document.querySelectorAll("article.turn .tokens")) box.hidden = !on;
  for (const text of document.querySelectorAll("article.turn .text")) text.hidden = on;
}

document.addEventListener("DOMContentLoaded", () => {
  const button = document.getElementById("toggle-tokens");
  if (button) button.addEventListener("click", () => toggleTokens(button));
});
