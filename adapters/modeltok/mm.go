package modeltok

import (
	"encoding/json"
	"math"
)

// mmTokenKeys are the config.json fields of multimodal models that name
// the placeholder token of each modality (LLaVA's image_token_index,
// Qwen2-VL's image_token_id, Qwen2-Audio's audio_token_index, ...).
var mmTokenKeys = map[string][]string{
	"image": {"image_token_index", "image_token_id"},
	"audio": {"audio_token_index", "audio_token_id"},
	"video": {"video_token_index", "video_token_id"},
}

// readMMPlaceholders reads the placeholder token ids from the model's
// config.json beside the tokenizer; nil without one, or when it names
// none. A config.json that does not parse names none: it is the
// tokenizer's neighbour, not part of it.
func readMMPlaceholders(dir string) map[string]uint32 {
	data, err := readOptional(dir, "config.json")
	if err != nil || data == nil {
		return nil
	}
	var cfg map[string]json.RawMessage
	if json.Unmarshal(data, &cfg) != nil {
		return nil
	}
	var out map[string]uint32
	for modality, keys := range mmTokenKeys {
		for _, k := range keys {
			var id int64
			if raw, ok := cfg[k]; !ok || json.Unmarshal(raw, &id) != nil || id < 0 || id > math.MaxUint32 {
				continue
			}
			if out == nil {
				out = map[string]uint32{}
			}
			out[modality] = uint32(id)
			break
		}
	}
	return out
}

// MMPlaceholders is the placeholder token id of each modality the model's
// config.json names ("image", "audio", "video"); nil when it names none.
// The caller must not change it.
func (m *Model) MMPlaceholders() map[string]uint32 { return m.mm }
