package modeltok

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

func TestMMPlaceholdersFromConfigJSON(t *testing.T) {
	for _, tc := range []struct {
		name, config string
		want         string
	}{
		{"llava-1.5", `{"model_type":"llava","image_token_index":32000,"vision_config":{"image_size":336,"patch_size":14}}`, "map[image:32000]"},
		{"qwen2-vl", `{"model_type":"qwen2_vl","image_token_id":151655,"video_token_id":151656}`, "map[image:151655 video:151656]"},
		{"qwen2-audio", `{"audio_token_index":151646}`, "map[audio:151646]"},
		{"text model", `{"model_type":"llama"}`, "map[]"},
		{"broken", `{"image_token_index":`, "map[]"},
		{"negative id", `{"image_token_index":-1}`, "map[]"},
	} {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(tc.config), 0o600); err != nil {
			t.Fatal(err)
		}
		if got := fmt.Sprint(readMMPlaceholders(dir)); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
	if got := readMMPlaceholders(t.TempDir()); got != nil {
		t.Errorf("without config.json: %v", got)
	}
}
