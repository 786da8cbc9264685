package frontend

import (
	"bytes"
	"encoding/json"
	"slices"

	"github.com/zeebo/xxh3"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/router"
)

// A chat message's content may hold images and audio (OpenAI content parts
// image_url, input_audio; vLLM's audio_url, video_url, ...). The body goes
// to the engine untouched; the router only needs to know, for its block
// hashes, where each item's placeholder tokens are in the prompt and which
// identifier the engine gives it (see router.MMItem):
//
//   - placeholders: the engine's /tokenize expands each item into its
//     placeholder tokens (vLLM since PR #34560, after 0.16), so the items
//     are the runs of the model's placeholder token id in the prompt, in
//     the order of the parts of that modality. An in-process chat template
//     renders no items, so such a chat is always tokenized by an engine.
//   - identifier: the part's uuid (vLLM's field), which vLLM uses as the
//     item's identifier unless the request sets mm_processor_kwargs (it
//     then hashes the uuid with them). Without a uuid the engine hashes
//     the decoded media with its processor's settings, which the router
//     cannot reproduce: the item is unknown, and the request is matched no
//     further than the first block that holds part of it.
//
// Anything the router cannot place (no placeholder id known for the
// modality, or runs that do not pair with the parts) makes the items
// unknown from the first run on, or from the prompt's start: a miss, never
// a false match.

// mmPart is one non-text content part of a chat request.
type mmPart struct {
	modality string
	uuid     string
	// hash tells different parts apart when the item is unknown: the
	// blocks after it are booked as load, never matched.
	hash uint64
}

// textParts are the content part types that hold no media.
var textParts = map[string]bool{"text": true, "input_text": true, "output_text": true, "refusal": true, "thinking": true}

// partModality names the modality of a media part's type, as vLLM's
// multimodal data dictionary keys it.
func partModality(typ string) string {
	switch typ {
	case "image_url", "input_image", "image_pil", "image_embeds":
		return "image"
	case "input_audio", "audio_url", "audio_embeds":
		return "audio"
	case "video_url", "video_embeds":
		return "video"
	}
	return typ
}

// chatMMParts lists the media parts of a chat's messages, in order; nil
// when there are none, or when the messages are not a list of objects
// (which the prompt's own checks report).
func chatMMParts(messages json.RawMessage) []mmPart {
	if !bytes.Contains(messages, []byte(`"type"`)) {
		return nil
	}
	var msgs []struct {
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(messages, &msgs) != nil {
		return nil
	}
	var out []mmPart
	for _, m := range msgs {
		c := bytes.TrimSpace(m.Content)
		if len(c) == 0 || c[0] != '[' {
			continue
		}
		var parts []json.RawMessage
		if json.Unmarshal(c, &parts) != nil {
			continue
		}
		for _, raw := range parts {
			var p struct {
				Type string `json:"type"`
				UUID string `json:"uuid"`
			}
			if json.Unmarshal(raw, &p) != nil || textParts[p.Type] {
				continue
			}
			out = append(out, mmPart{modality: partModality(p.Type), uuid: p.UUID, hash: xxh3.Hash(raw)})
		}
	}
	return out
}

// mmItems places parts on the prompt tokens: the runs of each modality's
// placeholder id, paired in order with that modality's parts. kwargs says
// the request sets mm_processor_kwargs, under which the engine does not
// use a uuid as it is.
func mmItems(tokens []uint32, parts []mmPart, placeholders map[string]uint32, kwargs bool) []router.MMItem {
	if len(parts) == 0 || len(tokens) == 0 {
		return nil
	}
	var items []router.MMItem
	done := map[string]bool{}
	for _, p := range parts {
		if done[p.modality] {
			continue
		}
		done[p.modality] = true
		var same []mmPart
		for _, q := range parts {
			if q.modality == p.modality {
				same = append(same, q)
			}
		}
		id, ok := placeholders[p.modality]
		var runs [][2]int
		if ok {
			runs = placeholderRuns(tokens, id)
		}
		if len(runs) != len(same) {
			// Unplaceable: unknown from the first placeholder, or from
			// the start when there is none.
			unknown := router.MMItem{Offset: 0, Length: 1, Hash: p.hash}
			if len(runs) > 0 {
				unknown.Offset, unknown.Length = runs[0][0], runs[0][1]
			}
			items = append(items, unknown)
			continue
		}
		for i, q := range same {
			it := router.MMItem{Offset: runs[i][0], Length: runs[i][1], Hash: q.hash}
			if q.uuid != "" && !kwargs {
				it.Hash, it.Known = blockhash.HashMMIdentifier(q.uuid)
			}
			items = append(items, it)
		}
	}
	slices.SortFunc(items, func(a, b router.MMItem) int { return a.Offset - b.Offset })
	return items
}

// placeholderRuns returns each maximal run of id in tokens as (offset,
// length).
func placeholderRuns(tokens []uint32, id uint32) [][2]int {
	var runs [][2]int
	for i := 0; i < len(tokens); {
		if tokens[i] != id {
			i++
			continue
		}
		j := i
		for j < len(tokens) && tokens[j] == id {
			j++
		}
		runs = append(runs, [2]int{i, j - i})
		i = j
	}
	return runs
}

// mmPlaceholders is the placeholder token id per modality for model: its
// in-process tokenizer's model config, else the configured ones.
func (f *Frontend) mmPlaceholders(model string) map[string]uint32 {
	if f.cfg.Tokenizer != nil {
		if m := f.cfg.Tokenizer(model); m != nil {
			if p := m.MMPlaceholders(); len(p) > 0 {
				return p
			}
		}
	}
	return f.cfg.MMPlaceholders
}
