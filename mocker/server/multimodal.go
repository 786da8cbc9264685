package server

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/kvrouter/kvrouter/mocker/engine"
	"github.com/kvrouter/kvrouter/mocker/tokenizer"
)

// The mocker serves chats with images and audio as a LLaVA-1.5-style model
// does: the chat template writes one placeholder per item where the item
// stands, and the engine expands it to a fixed number of placeholder
// tokens (LLaVA-1.5: 576 <image> tokens per image; here
// Config.MMTokensPerItem). Each item is identified as vLLM identifies it:
// by the content part's uuid when the client gives one, else by a digest
// of its data, standing in for vLLM's MultiModalHasher (which hashes the
// decoded media): SHA-256 of the part's URL or audio data, as 64 hex
// digits, the shape of vLLM's own identifiers. The items key the prompt's
// blocks and are published in their extra_keys (engine.MMFeature).

// DefaultMMTokensPerItem is LLaVA-1.5's placeholder tokens per image:
// (336 / 14)² patches.
const DefaultMMTokensPerItem = 576

// contentPart is one OpenAI (or vLLM) chat content part.
type contentPart struct {
	Type     string `json:"type"`
	Text     string `json:"text"`
	UUID     string `json:"uuid"`
	ImageURL *struct {
		URL string `json:"url"`
	} `json:"image_url"`
	InputAudio *struct {
		Data   string `json:"data"`
		Format string `json:"format"`
	} `json:"input_audio"`
	AudioURL *struct {
		URL string `json:"url"`
	} `json:"audio_url"`
}

// mediaItem is one media part: its placeholder and identifier.
type mediaItem struct {
	placeholder uint32
	identifier  string
}

func (p *contentPart) media() (mediaItem, error) {
	var it mediaItem
	var data string
	switch {
	case p.Type == "image_url" && p.ImageURL != nil && p.ImageURL.URL != "":
		it.placeholder, data = tokenizer.Image, p.ImageURL.URL
	case p.Type == "input_audio" && p.InputAudio != nil && p.InputAudio.Data != "":
		it.placeholder, data = tokenizer.Audio, p.InputAudio.Format+":"+p.InputAudio.Data
	case p.Type == "audio_url" && p.AudioURL != nil && p.AudioURL.URL != "":
		it.placeholder, data = tokenizer.Audio, p.AudioURL.URL
	case p.Type == "image_url" || p.Type == "input_audio" || p.Type == "audio_url":
		return it, fmt.Errorf("content part of type %q without its data", p.Type)
	default:
		return it, fmt.Errorf("content part of type %q is not supported", p.Type)
	}
	it.identifier = p.UUID
	if it.identifier == "" {
		sum := sha256.Sum256([]byte(data))
		it.identifier = hex.EncodeToString(sum[:])
	}
	return it, nil
}

// expandPlaceholders replaces each placeholder in ids with perItem copies,
// pairing them in order with items, as vLLM's processor updates a prompt;
// it fails, as vLLM does, when placeholders and items do not pair.
func expandPlaceholders(ids []uint32, items []mediaItem, perItem int) ([]uint32, []engine.MMFeature, error) {
	n := 0
	for _, id := range ids {
		if id == tokenizer.Image || id == tokenizer.Audio {
			n++
		}
	}
	if n == 0 && len(items) == 0 {
		return ids, nil, nil
	}
	if n != len(items) {
		return nil, nil, fmt.Errorf("the prompt has %d media placeholders for %d media items", n, len(items))
	}
	if perItem <= 0 {
		return nil, nil, errors.New("this model takes no media")
	}
	out := make([]uint32, 0, len(ids)+n*(perItem-1))
	mm := make([]engine.MMFeature, 0, n)
	k := 0
	for _, id := range ids {
		if id != tokenizer.Image && id != tokenizer.Audio {
			out = append(out, id)
			continue
		}
		if id != items[k].placeholder {
			return nil, nil, fmt.Errorf("media placeholder %d is %s where its item is %s", k, tokenizer.Word(id), tokenizer.Word(items[k].placeholder))
		}
		mm = append(mm, engine.MMFeature{Identifier: items[k].identifier, Offset: len(out), Length: perItem})
		for range perItem {
			out = append(out, id)
		}
		k++
	}
	return out, mm, nil
}
